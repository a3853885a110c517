package node

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/base64"
	"encoding/pem"
	"fmt"
	"io"
	"math/big"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/grabsvc"
	"redpacket.io/operator/internal/rain"
	"redpacket.io/operator/test/e2e/kit"
	"redpacket.io/operator/test/gatewaytest"
)

// The public side of the node: the platform's Gateway, Traefik from the image make
// image builds (redpacket-traefik), in its own namespace.
const (
	gatewayNS   = "e2e-gateway"
	gatewayName = "edge"
	publicZone  = "e2e.test"
)

// TestRainThroughTheGateway puts a real Gateway in front of the grab fleet, as a
// platform team does: the Gateway API's standard CRDs, Traefik (the
// redpacket-traefik image, a pod on the node) watching Gateway API routes and
// Ingresses, and a Gateway with an HTTPS listener whose certificate is a
// self-signed one in a Secret. An activity with spec.expose.httpRoute to that
// Gateway becomes Exposed with its https status.url, which serves the rain page; then
// 20,000 users grab through the Gateway's HTTPS address and 20,000 others through the
// grab Service's ClusterIP, in the same run: every user answered by the API, no
// packet twice, the money exact and booked once in PostgreSQL. The requests/s
// through the Gateway ÷ through the ClusterIP and both p99s are logged, never
// asserted. A budget exposed through the same Gateway serves a merchant's burst of
// group packets over HTTPS, and an activity with spec.expose.ingress through the same
// Traefik is Exposed with its Ingress's address and rained on over HTTPS too.
func TestRainThroughTheGateway(t *testing.T) {
	requireNode(t)
	const (
		name  = "gated"
		users = 20000
		count = int64(2 * users)
		total = count * 50
	)
	gatewaytest.InstallCRDs(t, env.node.Config)
	certPEM, keyPEM := selfSigned(t, "*."+publicZone)
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(certPEM) {
		t.Fatal("the self-signed certificate does not parse")
	}
	gatewayIP := startTraefik(t, certPEM, keyPEM)
	gatewayAddr := net.JoinHostPort(gatewayIP, "443")

	ns := namespace(t, "e2e-gated")
	host := "rain." + publicZone
	kubectl(t, activityManifest(ns, name, total, count, 2), "apply", "-f", "-")
	kubectl(t, fmt.Sprintf(`{"spec":{"expose":{"httpRoute":{"parentRefs":[{"name":%q,"namespace":%q,"sectionName":"https"}],"hostnames":[%q]}}}}`,
		gatewayName, gatewayNS, host), "-n", ns, "patch", "rpa", name, "--type=merge", "--patch-file=/dev/stdin")
	kubectl(t, "", "-n", ns, "wait", "--for=condition=Ready", "rpa/"+name, "--timeout=180s")
	available(t, ns, name+"-grab", 2, 2*time.Minute)
	exposedAfter := waitExposed(t, ns, name)
	a := activity(t, ns, name)
	if want := "https://" + host + "/"; a.Status.URL != want {
		t.Fatalf("status.url %q, want %q", a.Status.URL, want)
	}
	t.Logf("Exposed=True %s after Ready; status.url %s; Gateway at %s", exposedAfter.Round(100*time.Millisecond), a.Status.URL, gatewayAddr)
	tlsConf := &tls.Config{RootCAs: roots, ServerName: host, MinVersion: tls.VersionTLS12}
	checkPublicPage(t, a.Status.URL, gatewayAddr, tlsConf)

	// All users at once over 32 connections, the same for both paths: a user's wait
	// for a connection is in p50 and p99, the request's own time in the service's.
	spec := rain.Spec{Users: users, Connections: 32, Timeout: 30 * time.Second, RetryUnavailable: true, Token: tokens(t, ns, name)}
	viaGateway := spec
	viaGateway.URL, viaGateway.UserPrefix, viaGateway.TLSConfig, viaGateway.DialAddress = a.Status.URL+"v1/grab", "gw", tlsConf, gatewayAddr
	gw := rain.Run(t.Context(), viaGateway)
	viaClusterIP := spec
	viaClusterIP.URL, viaClusterIP.UserPrefix = grabURL(t, ns, name)+"/v1/grab", "ip"
	ip := rain.Run(t.Context(), viaClusterIP)

	rate := func(r rain.Result) float64 { return float64(r.Requests) / r.Elapsed.Seconds() }
	t.Logf("through the Gateway (HTTPS, Traefik): %d users, %d requests in %s, %.0f requests/s; users' p50 %s, p99 %s; requests' p50 %s, p99 %s",
		gw.Users, gw.Requests, gw.Elapsed.Round(time.Millisecond), rate(gw), gw.P50, gw.P99, gw.ServiceP50, gw.ServiceP99)
	t.Logf("through the ClusterIP (HTTP): %d users, %d requests in %s, %.0f requests/s; users' p50 %s, p99 %s; requests' p50 %s, p99 %s",
		ip.Users, ip.Requests, ip.Elapsed.Round(time.Millisecond), rate(ip), ip.P50, ip.P99, ip.ServiceP50, ip.ServiceP99)
	t.Logf("requests/s through the Gateway ÷ through the ClusterIP: %.2f (goal 0.6)", rate(gw)/rate(ip))
	for _, r := range []struct {
		via string
		r   rain.Result
	}{{"the Gateway", gw}, {"the ClusterIP", ip}} {
		if r.r.Failed != 0 || r.r.ByOutcome["error"] != 0 {
			t.Errorf("through %s: %d answers that are not the API's, %d users unanswered (first: %s)",
				r.via, r.r.Failed, r.r.ByOutcome["error"], r.r.FirstError)
		}
	}
	tally := kit.Sum(t, []rain.Result{gw, ip})
	t.Logf("rain: %s", tally)
	tally.CheckSoldOut(t, count, total)
	env.kit.WaitSoldOutAndSettled(t, ns, name, count, total, 3*time.Minute)
	tally.CheckBooked(t, env.balance, string(a.UID), activity(t, ns, name).Status, count, total)

	kubectl(t, "", "-n", ns, "delete", "rpa", name, "--timeout=120s")
	packetsThroughTheGateway(t, gatewayAddr, roots)
	rainThroughAnIngress(t, gatewayAddr, roots, certPEM, keyPEM)
}

// packetsThroughTheGateway: a budget with spec.expose.httpRoute to the same Gateway
// becomes Exposed with its https status.url, and a merchant's burst of 300 group
// packets (5 shares each, raced by groups of 7) is created and grabbed through the
// Gateway's HTTPS address: every packet created once, every share granted once, each
// group's shares summing to its packet.
func packetsThroughTheGateway(t *testing.T, gatewayAddr string, roots *x509.CertPool) {
	t.Helper()
	const name = "merchant"
	ns := namespace(t, "e2e-gated-budget")
	host := "packets." + publicZone
	kubectl(t, fmt.Sprintf(`apiVersion: redpacket.io/v1alpha1
kind: RedPacketBudget
metadata:
  name: %s
  namespace: %s
spec:
  total: 1000000
  currency: CNY
  packets: {maxTotal: 10000, maxCount: 10, minShare: 1, distributions: [Random], defaultTTL: 1h, maxTTL: 1h}
  grabService: {replicas: 1}
  expose:
    httpRoute:
      parentRefs: [{name: %s, namespace: %s, sectionName: https}]
      hostnames: [%s]
`, name, ns, gatewayName, gatewayNS, host), "apply", "-f", "-")
	kubectl(t, "", "-n", ns, "wait", "--for=condition=Ready", "rpb/"+name, "--timeout=180s")
	exposedAfter := eventually(t, 2*time.Minute, "the budget Exposed=True", func() error {
		b := &redpacketv1alpha1.RedPacketBudget{}
		if err := env.client.Get(t.Context(), client.ObjectKey{Namespace: ns, Name: name}, b); err != nil {
			return err
		}
		c := meta.FindStatusCondition(b.Status.Conditions, redpacketv1alpha1.ConditionExposed)
		if c == nil || c.Status != metav1.ConditionTrue {
			return fmt.Errorf("Exposed %v", c)
		}
		if want := "https://" + host + "/"; b.Status.URL != want {
			return fmt.Errorf("status.url %q, want %q", b.Status.URL, want)
		}
		return nil
	})
	t.Logf("budget: Exposed=True %s after Ready; status.url https://%s/", exposedAfter.Round(100*time.Millisecond), host)
	enc := kubectl(t, "", "-n", ns, "get", "secret", name+"-sender", "-o", "jsonpath={.data.token}")
	token, err := base64.StdEncoding.DecodeString(enc)
	if err != nil || len(token) == 0 {
		t.Fatalf("the sender credential: %q, %v", enc, err)
	}
	tlsConf := &tls.Config{RootCAs: roots, ServerName: host, MinVersion: tls.VersionTLS12}
	// The route's status can be written before Traefik serves it: wait for the list of
	// live packets to come from the grab service through the Gateway.
	c := edgeClient(tlsConf, gatewayAddr)
	defer c.CloseIdleConnections()
	eventually(t, time.Minute, "GET https://"+host+"/v1/packets through the Gateway", func() error {
		req, err := http.NewRequestWithContext(t.Context(), http.MethodGet, "https://"+host+"/v1/packets", nil)
		if err != nil {
			return err
		}
		req.Header.Set("Authorization", "Bearer "+string(token))
		resp, err := c.Do(req)
		if err != nil {
			return err
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK || resp.Header.Get("Content-Type") != "application/json" {
			return fmt.Errorf("HTTP %d, Content-Type %q", resp.StatusCode, resp.Header.Get("Content-Type"))
		}
		return nil
	})
	spec := rain.GroupSpec{URL: "https://" + host, SenderToken: string(token), Packets: 300, IDPrefix: "gw-order-", Total: 500, Shares: 5,
		Members: func(int) int { return 7 }, Workers: 32,
		TLSConfig: tlsConf, DialAddress: gatewayAddr}
	res := rain.RunGroups(t.Context(), spec)
	if len(res.Errors) > 0 || res.Created != spec.Packets {
		t.Fatalf("%d of %d packets created through the Gateway; unexpected answers: %v", res.Created, spec.Packets, res.Errors)
	}
	claimed, err := res.Check(spec)
	if err != nil {
		t.Fatal(err)
	}
	if want := int64(spec.Packets) * spec.Total; claimed != want {
		t.Errorf("%d claimed through the Gateway, want every share: %d", claimed, want)
	}
	t.Logf("budget: %d packets created through the Gateway in %s; %d grabs (%d sold out) in %s; %d claimed",
		spec.Packets, res.CreateElapsed.Round(time.Millisecond), res.Grabs, res.SoldOut, res.GrabElapsed.Round(time.Millisecond), claimed)
	kubectl(t, "", "-n", ns, "delete", "rpb", name, "--wait=false")
}

// rainThroughAnIngress: an activity with spec.expose.ingress (class traefik, a host
// under the test zone, a TLS Secret) through the same Traefik: Exposed=True once
// Traefik writes the Ingress's load balancer address, status.url serves the page,
// and 2,000 users grab its 2,000 packets over HTTPS, exactly.
func rainThroughAnIngress(t *testing.T, gatewayAddr string, roots *x509.CertPool, certPEM, keyPEM []byte) {
	t.Helper()
	const (
		name  = "dropped"
		count = int64(2000)
		total = count * 10
	)
	ns := namespace(t, "e2e-ingress")
	host := "drop." + publicZone
	tlsSecret(t, ns, "drop-tls", certPEM, keyPEM)
	kubectl(t, activityManifest(ns, name, total, count, 1), "apply", "-f", "-")
	kubectl(t, fmt.Sprintf(`{"spec":{"expose":{"ingress":{"className":"traefik","host":%q,"tlsSecretName":"drop-tls"}}}}`, host),
		"-n", ns, "patch", "rpa", name, "--type=merge", "--patch-file=/dev/stdin")
	kubectl(t, "", "-n", ns, "wait", "--for=condition=Ready", "rpa/"+name, "--timeout=180s")
	exposedAfter := waitExposed(t, ns, name)
	a := activity(t, ns, name)
	if want := "https://" + host + "/"; a.Status.URL != want {
		t.Fatalf("the Ingress's status.url %q, want %q", a.Status.URL, want)
	}
	t.Logf("Ingress: Exposed=True %s after Ready; status.url %s", exposedAfter.Round(100*time.Millisecond), a.Status.URL)
	tlsConf := &tls.Config{RootCAs: roots, ServerName: host, MinVersion: tls.VersionTLS12}
	checkPublicPage(t, a.Status.URL, gatewayAddr, tlsConf)
	r := rain.Run(t.Context(), rain.Spec{URL: a.Status.URL + "v1/grab", Users: int(count), Connections: 16, Timeout: 10 * time.Second,
		RetryUnavailable: true, Token: tokens(t, ns, name), UserPrefix: "in", TLSConfig: tlsConf, DialAddress: gatewayAddr})
	t.Logf("through the Ingress (HTTPS, Traefik): %d users, %d requests in %s, p99 %s", r.Users, r.Requests, r.Elapsed.Round(time.Millisecond), r.P99)
	tally := kit.Sum(t, []rain.Result{r})
	tally.CheckSoldOut(t, count, total)
	env.kit.WaitSoldOutAndSettled(t, ns, name, count, total, 3*time.Minute)
	kubectl(t, "", "-n", ns, "delete", "rpa", name, "--timeout=120s")
}

// waitExposed waits for the activity's Exposed condition to be True and returns how
// long it took.
func waitExposed(t *testing.T, ns, name string) time.Duration {
	t.Helper()
	return eventually(t, 2*time.Minute, "Exposed=True", func() error {
		c := meta.FindStatusCondition(activity(t, ns, name).Status.Conditions, redpacketv1alpha1.ConditionExposed)
		if c == nil {
			return fmt.Errorf("no Exposed condition")
		}
		if c.Status != metav1.ConditionTrue {
			return fmt.Errorf("Exposed=%s %s: %s", c.Status, c.Reason, c.Message)
		}
		return nil
	})
}

// checkPublicPage asks the public URL for the rain page through the Gateway's
// address, over TLS with the test's roots: it must be the grab service's page, under
// its Content-Security-Policy.
func checkPublicPage(t *testing.T, url, gatewayAddr string, tlsConf *tls.Config) {
	t.Helper()
	c := edgeClient(tlsConf, gatewayAddr)
	defer c.CloseIdleConnections()
	eventually(t, time.Minute, "GET "+url+" through the Gateway", func() error {
		resp, err := c.Get(url)
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		if resp.StatusCode != http.StatusOK || resp.Header.Get("Content-Security-Policy") != grabsvc.PageContentSecurityPolicy ||
			!strings.Contains(string(body), "<html") {
			return fmt.Errorf("HTTP %d, CSP %q, %d bytes", resp.StatusCode, resp.Header.Get("Content-Security-Policy"), len(body))
		}
		return nil
	})
}

// edgeClient is an HTTP client that reaches every URL at gatewayAddr, with tlsConf:
// a public name, as a phone asks for it, through the Gateway's address.
func edgeClient(tlsConf *tls.Config, gatewayAddr string) *http.Client {
	d := &net.Dialer{Timeout: 5 * time.Second}
	return &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{TLSClientConfig: tlsConf,
		DialContext: func(ctx context.Context, network, _ string) (net.Conn, error) {
			return d.DialContext(ctx, network, gatewayAddr)
		}}}
}

// startTraefik installs the platform's side in gatewayNS: the TLS Secret, Traefik's
// RBAC, its Service (443 and 80 to the pod's 8443 and 8000), its Deployment from the
// suite's redpacket-traefik image with the kubernetesGateway and kubernetesIngress
// providers publishing the Service's ClusterIP as their address, the IngressClass
// and GatewayClass traefik, and the Gateway edge with an HTTPS listener for the test
// zone that admits routes of every namespace. It returns the Service's ClusterIP.
func startTraefik(t *testing.T, certPEM, keyPEM []byte) string {
	t.Helper()
	kubectl(t, "", "create", "namespace", gatewayNS)
	tlsSecret(t, gatewayNS, "edge-tls", certPEM, keyPEM)
	kubectl(t, traefikBase(gatewayNS), "apply", "-f", "-")
	svc := &corev1.Service{}
	if err := env.client.Get(t.Context(), client.ObjectKey{Namespace: gatewayNS, Name: "traefik"}, svc); err != nil {
		t.Fatal(err)
	}
	ip := svc.Spec.ClusterIP
	kubectl(t, traefikDeployment(gatewayNS, env.images["traefik"].Tag, ip), "apply", "-f", "-")
	available(t, gatewayNS, "traefik", 1, 2*time.Minute)
	kubectl(t, fmt.Sprintf(`apiVersion: gateway.networking.k8s.io/v1
kind: GatewayClass
metadata:
  name: traefik
spec:
  controllerName: %s
---
apiVersion: gateway.networking.k8s.io/v1
kind: Gateway
metadata:
  name: %s
  namespace: %s
spec:
  gatewayClassName: traefik
  listeners:
  - name: https
    protocol: HTTPS
    port: 8443
    hostname: "*.%s"
    tls:
      mode: Terminate
      certificateRefs: [{name: edge-tls}]
    allowedRoutes:
      namespaces: {from: All}
`, gatewaytest.ControllerName, gatewayName, gatewayNS, publicZone), "apply", "-f", "-")
	eventually(t, time.Minute, "the Gateway Programmed by Traefik", func() error {
		out := kubectl(t, "", "-n", gatewayNS, "get", "gateway", gatewayName, "-o", `jsonpath={.status.conditions[?(@.type=="Programmed")].status}`)
		if out != "True" {
			return fmt.Errorf("Programmed=%q", out)
		}
		return nil
	})
	return ip
}

// traefikBase is Traefik's ServiceAccount, RBAC, Service and IngressClass.
func traefikBase(ns string) string {
	return fmt.Sprintf(`apiVersion: v1
kind: ServiceAccount
metadata: {name: traefik, namespace: %[1]s}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: e2e-traefik}
rules:
- apiGroups: [""]
  resources: [services, secrets, configmaps, namespaces, nodes]
  verbs: [get, list, watch]
- apiGroups: [discovery.k8s.io]
  resources: [endpointslices]
  verbs: [get, list, watch]
- apiGroups: [networking.k8s.io]
  resources: [ingresses, ingressclasses]
  verbs: [get, list, watch]
- apiGroups: [networking.k8s.io]
  resources: [ingresses/status]
  verbs: [update, patch]
- apiGroups: [gateway.networking.k8s.io]
  resources: ["*"]
  verbs: [get, list, watch]
- apiGroups: [gateway.networking.k8s.io]
  resources: [gatewayclasses/status, gateways/status, httproutes/status, grpcroutes/status, backendtlspolicies/status]
  verbs: [update, patch]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: e2e-traefik}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: e2e-traefik}
subjects: [{kind: ServiceAccount, name: traefik, namespace: %[1]s}]
---
apiVersion: v1
kind: Service
metadata: {name: traefik, namespace: %[1]s}
spec:
  selector: {app: traefik}
  ports:
  - {name: websecure, port: 443, targetPort: 8443}
  - {name: web, port: 80, targetPort: 8000}
---
apiVersion: networking.k8s.io/v1
kind: IngressClass
metadata: {name: traefik}
spec:
  controller: traefik.io/ingress-controller
`, ns)
}

// traefikDeployment runs the image as its non-root user on unprivileged ports, with
// the providers' status address the Service's ClusterIP ip.
func traefikDeployment(ns, image, ip string) string {
	return fmt.Sprintf(`apiVersion: apps/v1
kind: Deployment
metadata: {name: traefik, namespace: %s}
spec:
  replicas: 1
  selector: {matchLabels: {app: traefik}}
  template:
    metadata: {labels: {app: traefik, app.kubernetes.io/name: traefik}}
    spec:
      serviceAccountName: traefik
      securityContext: {runAsNonRoot: true, seccompProfile: {type: RuntimeDefault}}
      containers:
      - name: traefik
        image: %s
        imagePullPolicy: Never
        args:
        - --global.checkNewVersion=false
        - --global.sendAnonymousUsage=false
        - --entryPoints.web.address=:8000
        - --entryPoints.websecure.address=:8443
        - --entryPoints.websecure.http.tls=true
        - --ping=true
        - --ping.entryPoint=web
        - --providers.kubernetesGateway=true
        - --providers.kubernetesGateway.statusAddress.ip=%[3]s
        - --providers.kubernetesIngress=true
        - --providers.kubernetesIngress.ingressEndpoint.ip=%[3]s
        ports:
        - {name: web, containerPort: 8000}
        - {name: websecure, containerPort: 8443}
        readinessProbe:
          httpGet: {path: /ping, port: 8000}
          periodSeconds: 2
        securityContext:
          allowPrivilegeEscalation: false
          readOnlyRootFilesystem: true
          capabilities: {drop: [ALL]}
`, ns, image, ip)
}

// tlsSecret creates a kubernetes.io/tls Secret.
func tlsSecret(t *testing.T, ns, name string, certPEM, keyPEM []byte) {
	t.Helper()
	s := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name}, Type: corev1.SecretTypeTLS,
		Data: map[string][]byte{corev1.TLSCertKey: certPEM, corev1.TLSPrivateKeyKey: keyPEM}}
	if err := env.client.Create(t.Context(), s); err != nil {
		t.Fatalf("creating Secret %s/%s: %v", ns, name, err)
	}
}

// selfSigned makes a self-signed ECDSA certificate for the DNS name (a wildcard of
// the test zone), valid for an hour: both the Gateway's listener and the Ingress
// serve it, and the clients trust it alone.
func selfSigned(t *testing.T, dnsName string) (certPEM, keyPEM []byte) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(time.Now().UnixNano()), Subject: pkix.Name{CommonName: dnsName}, DNSNames: []string{dnsName},
		NotBefore: time.Now().Add(-time.Minute), NotAfter: time.Now().Add(time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		BasicConstraintsValid: true, IsCA: true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER})
}
