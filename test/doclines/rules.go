package doclines

// The rules below are data: which untagged blocks are not shell, and, for every shell
// line of README.md and docs/*.md, whether it runs against the real-node test cluster
// (test/e2e/node, TestDocsShellLines) or why it cannot run there. The first rule of a
// line's document (or of every document, Doc "") that matches it wins. A line no rule
// matches fails TestEveryDocLineClassified, and so does a rule that matches nothing.
//
// The test cluster is the node suite's: the dev Redis from config/dev-redis and the
// operator from the Helm chart in redpacket-system, the operator's settlement keys
// Secret, bin/kubectl and a kubectl-rpa built from this tree on the PATH, KUBECONFIG
// set, and the repository root as the working directory. The documents run in the
// order of Documents (README.md first), each in one bash, so the docs after the README
// find what its quick start created (the samples in default, the keys).

// NotShellBlocks are the untagged fenced blocks that are not shell.
var NotShellBlocks = []NotShell{
	{Doc: "docs/architecture.md", First: `kubectl apply / GitOps ── RedPacketActivity`, Reason: "a diagram of the parts"},
	{Doc: "docs/architecture.md", First: `create +committed`, Reason: "a diagram of the phases"},
	{Doc: "docs/grab-api.md", First: `^\{"outcome":"unavailable"`, Reason: "a response body"},
	{Doc: "docs/grab-api.md", First: `^token += base64url`, Reason: "the token format"},
	{Doc: "docs/grab-api.md", First: `^payload = \{`, Reason: "token payload formats"},
	{Doc: "docs/operations.md", First: `^appendonly yes`, Reason: "redis.conf lines"},
	{Doc: "docs/rain-page.md", First: `^Content-Security-Policy:`, Reason: "response headers"},
}

// Rules classify every shell line.
var Rules = []Rule{
	// The sample budget (config/samples/, no webhook: Ready without a balance
	// system), on every page that uses it, through a port-forward of its grab Service.
	{Doc: "README.md", InBlock: `^# the sample budget`, Match: `.`, Run: true},
	{Doc: "docs/grab-api.md", Match: `(group-packets|/v1/packets|localhost:8082|^SENDER=)`, Run: true},
	// docs/budgets.md: the quotas sample, applied, reached by hand and deleted.
	{Doc: "docs/budgets.md", InBlock: `^# one-a-day: `, Match: `.`, Run: true},
	{Doc: "docs/kubectl-rpa.md", Match: `^kubectl rpa (send|packet|packets) group-packets`, Run: true},

	// Set-up commands of a whole node or machine, and building.
	{Match: `^make (demo|test)\b`, Reason: "starts a node of its own (one node at a time); make test runs this very test"},
	{Match: `^make (image|bench)\b`, Reason: "builds images or runs the benchmarks, minutes on 2 cores; the suite built and imported its own images"},
	{Match: `^make build && export PATH=`, Reason: "the test builds kubectl-rpa from this tree itself and puts it first on the PATH"},
	{Match: `^make build\b`, Reason: "the test builds kubectl-rpa from this tree itself"},
	{Match: `^export PATH="\$PWD/bin:\$PATH"$`, Reason: "the test puts bin/ and its own kubectl-rpa on the PATH itself"},
	{Match: `^make render && `, Reason: "a second install of the operator; the test cluster has it from the chart"},
	{Match: `^kind load `, Reason: "the test cluster is not kind: the suite imports its images into the node's containerd"},
	{Match: `^ctr -n k8s.io images import dist/redpacket-operator-<V>\.tar$`, Reason: "a placeholder version; the suite imports its images itself"},
	{Match: `^helm install `, Reason: "the real helm CLI is not installed here; the suite installs the same chart through the Helm library (test/cluster InstallChart)"},
	{Match: `(^|\s)go (test|run) `, Reason: "a Go test or program, run by make test or by hand, not a command against the cluster"},

	// README.md: the quick start, in order, on the test cluster.
	{Doc: "README.md", Match: `^bin/kubectl create (namespace redpacket-system|secret generic redpacket-redis -n redpacket-system )`,
		Reason: "the suite made the operator's namespace and its Redis Secret (a random password) before the dev Redis and the operator started (test/cluster); a second create fails, and a new password would not reach the running Redis"},
	{Doc: "README.md", Match: `^bin/kubectl apply -k config/dev-redis$`, Run: true, Reason: "the same apply the suite made: unchanged"},
	{Doc: "README.md", Match: `^bin/kubectl (apply -f config/samples/|wait --for=condition=Ready rpa/)`, Run: true},
	{Doc: "README.md", Match: `^bin/kubectl create secret generic grab-hmac --from-literal=key="\$\(openssl rand -hex 32\)"$`, Run: true},
	{Doc: "README.md", Match: `^bin/kubectl -n redpacket-system create secret generic redpacket-settlement-keys .* \| bin/kubectl apply --server-side -f -$`, Run: true,
		Reason: "adds balance.payments.svc.cluster.local_8080 to the Secret the suite made, whose key for its balance system stays"},
	{Doc: "README.md", Match: `^kubectl rpa (status|rain|token|pause|resume) `, Run: true},
	{Doc: "README.md", Match: `^kubectl (apply -f config/samples/|wait --for=condition=Ready rpa/|get rpa|explain rpa\.spec)`, Run: true},
	{Doc: "README.md", Match: `^kubectl port-forward service/[a-z-]+-grab [0-9:]+ >/dev/null &$`, Run: true},
	{Doc: "README.md", Match: `^(ENDPOINT|TOKEN)=`, Run: true},
	{Doc: "README.md", Match: `^curl -s `, Run: true},

	// docs/balance.md: the reference balance system on the host.
	{Doc: "docs/balance.md", Match: `^hack/ensure-postgres\.sh$`, Reason: "installs PostgreSQL on the host through the package manager (root); make test runs it before the tests"},

	// docs/benchmarks.md: nothing but the benchmark commands above.

	// docs/grab-api.md: against the README's samples through port-forwards.
	{Doc: "docs/grab-api.md", Match: `^printf '%s\.%s\.%s' "\$id" "\$timestamp" "\$body" \| openssl dgst -sha256 -hmac "\$key"`, Reason: "the balance system's side: checks the v1 signature of a delivery it received; TestShellV1OfTheDocs (pkg/webhooksig) runs it against the operator's signature"},
	{Doc: "docs/operations.md", Match: `^(openssl genpkey -algorithm ed25519 -out operator-ed25519\.pem|echo "whpk_\$\(openssl pkey -in operator-ed25519\.pem .*|shred -u operator-ed25519\.pem)$`, Reason: "makes a production balance system's Ed25519 key pair; TestOpenSSLKeysOfTheDocs (pkg/webhooksig) runs these commands and checks the pair"},
	{Doc: "docs/operations.md", InBlock: `^s=redpacket-settlement-keys k=balance\.payments`, Match: `.`, Reason: "rotates the key of a production balance system's host, which the test cluster has no key for; TestOperatorSignsStandardWebhooksWithTheSecretsKeys plays a rotation on a real API server"},
	{Doc: "docs/grab-api.md", Match: `^curl \.\.\. `, Reason: "an elided transcript line (curl ... stands for the command above it)"},
	{Doc: "docs/grab-api.md", Match: `^(ENDPOINT|key|user|uid|payload|token)=`, Run: true},
	{Doc: "docs/grab-api.md", Match: `^b64url\(\) \{`, Run: true},
	{Doc: "docs/grab-api.md", Match: `^kubectl port-forward service/[a-z-]+-grab [0-9:]+ >/dev/null &$`, Run: true},
	{Doc: "docs/grab-api.md", Match: `^kubectl patch rpa quiz-night `, Run: true, Reason: "pauses quiz-night; docs/kubectl-rpa.md resumes it"},
	{Doc: "docs/grab-api.md", Match: `^curl -s `, Run: true, Reason: "exit 0 whatever the outcome: the outcomes shown need an activity in that state"},

	// docs/kubectl-rpa.md.
	{Doc: "docs/kubectl-rpa.md", Match: `kubectl rpa token rpb/group-packets `, Reason: "the sample budget takes no user tokens (no spec.grabService.auth); budget tokens are tested against a real packet server (internal/rpactl, TestBudgetTokenAgainstThePacketServer)"},
	{Doc: "docs/kubectl-rpa.md", Match: `^kubectl rpa rain rehearsal `, Reason: "an activity named rehearsal of 1000 packets, which the docs do not create; the README rains on its sample"},
	{Doc: "docs/kubectl-rpa.md", Match: `^kubectl rpa (status|pause|resume|replay-dead-letters) `, Run: true},
	{Doc: "docs/kubectl-rpa.md", Match: `^kubectl rpa --version$`, Run: true},
	{Doc: "docs/kubectl-rpa.md", Match: `^kubectl wait `, Run: true},
	{Doc: "docs/kubectl-rpa.md", Match: `^kubectl (-n redpacket-system )?port-forward service/[a-z-]+ [0-9:]+ >/dev/null &$`, Run: true},
	{Doc: "docs/kubectl-rpa.md", Match: `^export REDIS_(USERNAME|PASSWORD)="\$\(kubectl -n redpacket-system get secret redpacket-redis -o jsonpath='\{\.data\.(username|password)\}' \| base64 -d\)"$`, Run: true,
		Reason: "the operator's Redis user, from the Secret the suite made, for replay-dead-letters --redis-addr"},
	{Doc: "docs/kubectl-rpa.md", Match: `^curl -s `, Run: true},

	// docs/monitoring.md: a production install and Argo CD.
	{Doc: "docs/monitoring.md", Match: `^kubectl (create namespace|label namespace) redpacket-system`, Reason: "the first steps of a production install; the suite made this namespace, and enforcing restricted would change it for the other tests"},
	{Doc: "docs/monitoring.md", Match: `^kubectl -n argocd patch configmap argocd-cm `, Reason: "needs Argo CD, which the test cluster does not run"},

	// docs/operations.md.
	{Doc: "docs/operations.md", Match: `^kubectl apply --server-side -f https://github\.com/kubernetes-sigs/gateway-api/releases/download/v[0-9.]+/standard-install\.yaml$`,
		Reason: "installs the Gateway API's CRDs from the internet; the test cluster runs without them, and the controllers tests install the same CRDs from the module cache (TestExposeThroughAGatewayRoute)"},
	{Doc: "docs/operations.md", Match: `^(openssl req -x509 .* -out tls\.crt|kubectl create secret tls rain-example-com-tls )`,
		Reason: "a certificate for rain.example.com, which nothing on the test cluster serves: it has no Gateway or Ingress controller"},
	{Doc: "docs/operations.md", Match: `^kubectl get rpa quiz-night -o jsonpath=`, Run: true},
	{Doc: "docs/operations.md", Match: `^kubectl describe rpa quiz-night\b`, Run: true},
	{Doc: "docs/operations.md", Match: `^kubectl wait --for=`, Run: true},
	{Doc: "docs/operations.md", Match: `^kubectl annotate rpa quiz-night redpacket\.io/accept-redis-state=`, Reason: "accepts a rolled-back Redis: only for a fenced activity, played by the fault tests (test/faults, controllers)"},
	{Doc: "docs/operations.md", Match: `^kubectl (scale|autoscale) deployment quiz-night-grab `, Reason: "8 to 20 grab pods do not fit beside the suite's on 2 cores, and autoscaling needs a metrics server"},
	{Doc: "docs/operations.md", Match: `^kubectl get hpa,pdb quiz-night-grab$`, Reason: "the sample activity has no spec.grabService.autoscaling, so there is no HPA to show; TestPrewarmHoldsTheAutoscalerMinimumOverTheWindow (controllers) plays the HPA and PodDisruptionBudget on a real API server"},
	{Doc: "docs/operations.md", Match: `^kubectl -n redpacket-system create secret generic redpacket-settlement-keys .* \| kubectl apply --server-side -f -$`, Run: true},
	{Doc: "docs/operations.md", Match: `^kubectl (-n redpacket-system )?create secret generic (redis-conn|grab-hmac|redpacket-settlement-keys) `, Reason: "the Secrets table's examples of each shape; the README's quick start made grab-hmac and the settlement key, and there is no Redis at redis:6379"},
	{Doc: "docs/operations.md", Match: `^kubectl create secret generic redpacket-redis -n redpacket-system `, Reason: "the operator's Redis Secret, which the suite made before the dev Redis and the operator started; a second create fails"},
	{Doc: "docs/operations.md", Match: `^redis-cli `, Reason: "redis-cli against the operator's Redis with a UID or function-name placeholder"},
	{Doc: "docs/operations.md", Match: `^uid=\$\(kubectl get rpa quiz-night `, Run: true},
	{Doc: "docs/operations.md", Match: `^grabsvc replay-dead-letters `, Reason: "the grab binary's command, run inside a grab pod; docs/kubectl-rpa.md runs the plugin's replay"},
	{Doc: "docs/operations.md", InBlock: `^export KUBECONFIG=/path/to/kubeconfig$`, Match: `.`,
		Reason: "running the operator and a grab service by hand, on a control plane without a node (make demo ARGS=\"--host --keep\") and a redis-server on 6379"},

	// docs/rain-page.md.
	{Doc: "docs/rain-page.md", Match: `^bin/grabsvc --activity quiz-night --listen :8080 \.\.\.`, Reason: "a grab service run by hand, its flags elided"},
}
