package rpactl

import (
	"context"
	"fmt"
	"io"
	"net/http"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	corev1client "k8s.io/client-go/kubernetes/typed/core/v1"
	"k8s.io/client-go/tools/portforward"
	"k8s.io/client-go/transport/spdy"
	streamhttp "k8s.io/streaming/pkg/httpstream"
	"sigs.k8s.io/controller-runtime/pkg/client"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
)

// forward is a port-forward from a loopback port of this machine to a pod.
type forward struct {
	// URL is http://127.0.0.1:<local port>.
	URL string
	// Pod is the pod's name.
	Pod  string
	stop func()
}

// Close ends the port-forward and waits until it has stopped.
func (f *forward) Close() { f.stop() }

// grabServiceName is the grab Service the operator creates for an activity.
func grabServiceName(a *redpacketv1alpha1.RedPacketActivity) string { return a.Name + "-grab" }

// forwardToGrabPod port-forwards a random loopback port to a Ready pod of the
// activity's grab Service (the pods its selector picks, on the Service's target
// port), through the API server as kubectl port-forward does: WebSockets, falling
// back to SPDY. It needs get on services, list on pods and create on pods/portforward.
func (s *session) forwardToGrabPod(ctx context.Context, a *redpacketv1alpha1.RedPacketActivity, errOut io.Writer) (*forward, error) {
	return s.forwardToService(ctx, a.Namespace, grabServiceName(a), errOut)
}

// forwardToService port-forwards a random loopback port to a Ready pod of the
// Service namespace/svcName, as forwardToGrabPod does (a budget's grab Service is
// "<budget>-grab").
func (s *session) forwardToService(ctx context.Context, namespace, svcName string, errOut io.Writer) (*forward, error) {
	svc := &corev1.Service{}
	if err := s.client.Get(ctx, client.ObjectKey{Namespace: namespace, Name: svcName}, svc); err != nil {
		return nil, fmt.Errorf("reading the grab Service %s/%s: %w", namespace, svcName, err)
	}
	if len(svc.Spec.Selector) == 0 || len(svc.Spec.Ports) == 0 {
		return nil, fmt.Errorf("the grab Service %s/%s has no selector or no port", namespace, svcName)
	}
	pods := &corev1.PodList{}
	if err := s.client.List(ctx, pods, client.InNamespace(namespace), client.MatchingLabels(svc.Spec.Selector)); err != nil {
		return nil, fmt.Errorf("listing the grab pods of %s/%s: %w", namespace, svcName, err)
	}
	pod := pickReadyPod(pods.Items)
	if pod == nil {
		return nil, fmt.Errorf("the grab Service %s/%s has no Ready pod (of %d)", namespace, svcName, len(pods.Items))
	}
	port, err := targetPort(svc.Spec.Ports[0], pod)
	if err != nil {
		return nil, fmt.Errorf("grab pod %s: %w", pod.Name, err)
	}

	core, err := corev1client.NewForConfig(s.config)
	if err != nil {
		return nil, fmt.Errorf("creating the core API client: %w", err)
	}
	url := core.RESTClient().Post().Resource("pods").Namespace(pod.Namespace).Name(pod.Name).SubResource("portforward").URL()
	transport, upgrader, err := spdy.RoundTripperFor(s.config)
	if err != nil {
		return nil, fmt.Errorf("port-forward transport: %w", err)
	}
	spdyDialer := spdy.NewDialerForStreaming(upgrader, &http.Client{Transport: transport}, http.MethodPost, url)
	wsDialer, err := portforward.NewSPDYOverWebsocketDialerForStreaming(url, s.config)
	if err != nil {
		return nil, fmt.Errorf("port-forward dialer: %w", err)
	}
	dialer := portforward.NewFallbackDialerForStreaming(wsDialer, spdyDialer, func(err error) bool {
		return streamhttp.IsUpgradeFailure(err) || streamhttp.IsHTTPSProxyError(err)
	})

	fctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	ready := make(chan struct{})
	fw, err := portforward.NewOnAddressesForStreamingWithContext(fctx, dialer, []string{"127.0.0.1"}, []string{fmt.Sprintf("0:%d", port)},
		ready, io.Discard, errOut)
	if err != nil {
		cancel()
		return nil, fmt.Errorf("port-forward to pod %s: %w", pod.Name, err)
	}
	done := make(chan error, 1)
	go func() { done <- fw.ForwardPorts() }()
	stop := func() {
		cancel()
		<-done
	}
	select {
	case <-ready:
	case err := <-done:
		cancel()
		return nil, fmt.Errorf("port-forward to pod %s: %w", pod.Name, err)
	case <-ctx.Done():
		stop()
		return nil, ctx.Err()
	}
	ports, err := fw.GetPorts()
	if err != nil || len(ports) != 1 {
		stop()
		return nil, fmt.Errorf("port-forward to pod %s: no local port (%v)", pod.Name, err)
	}
	return &forward{URL: fmt.Sprintf("http://127.0.0.1:%d", ports[0].Local), Pod: pod.Name, stop: stop}, nil
}

// pickReadyPod returns the Ready pod, not being deleted, with the first name, or nil.
func pickReadyPod(pods []corev1.Pod) *corev1.Pod {
	var picked *corev1.Pod
	for i := range pods {
		p := &pods[i]
		if p.DeletionTimestamp != nil || p.Status.Phase != corev1.PodRunning || !podReady(p) {
			continue
		}
		if picked == nil || p.Name < picked.Name {
			picked = p
		}
	}
	return picked
}

func podReady(p *corev1.Pod) bool {
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}

// targetPort resolves a Service port's target port on a pod: a number as it is (none
// means the Service port's own number), a name through the pod's container ports.
func targetPort(sp corev1.ServicePort, pod *corev1.Pod) (int32, error) {
	tp := sp.TargetPort
	if tp.Type == intstr.Int {
		if tp.IntVal == 0 {
			return sp.Port, nil
		}
		return tp.IntVal, nil
	}
	for _, c := range pod.Spec.Containers {
		for _, p := range c.Ports {
			if p.Name == tp.StrVal {
				return p.ContainerPort, nil
			}
		}
	}
	return 0, fmt.Errorf("no container port named %q", tp.StrVal)
}
