# redpacket-operator

GO ?= go
CONTROLLER_GEN ?= $(GO) tool controller-gen
KUBECTL ?= bin/kubectl
TEST_FLAGS ?= -count=1 -timeout 30m
VERSION ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
# Stamps VERSION into every binary; each one prints it for --version.
LDFLAGS ?= -X redpacket.io/operator/internal/version.version=$(VERSION)

.PHONY: all
all: build

##@ Development

.PHONY: manifests
manifests: ## Generate the CRD and the manager's RBAC role.
	$(CONTROLLER_GEN) crd paths=./api/... output:crd:artifacts:config=config/crd/bases
	$(CONTROLLER_GEN) rbac:roleName=manager-role paths=./controllers/... output:rbac:artifacts:config=config/rbac

.PHONY: generate
generate: ## Generate deepcopy code.
	$(CONTROLLER_GEN) object:headerFile=hack/boilerplate.go.txt paths=./api/...

.PHONY: chart
chart: ## Generate the monitors, alert rules and dashboard (config/prometheus, config/grafana), Argo CD's health check patch and the Helm chart (charts/redpacket-operator) from config/.
	$(GO) run ./hack/chart

.PHONY: fmt
fmt: ## gofmt the tree.
	gofmt -w $$(git ls-files '*.go')

.PHONY: vet
vet: ## go vet the tree.
	$(GO) vet ./...

.PHONY: controlplane
controlplane: ## Build kube-apiserver, etcd, kubectl and the node components into bin/ (cached).
	hack/build-controlplane.sh

.PHONY: traefik
traefik: ## Build the Traefik proxy (Gateway API and Ingress) into bin/ from hack/tools/traefik (cached); the tests of the grab API through a Gateway run it.
	hack/build-controlplane.sh traefik

.PHONY: redis
redis: ## Make sure redis-server and its tools are installed.
	hack/ensure-redis.sh

.PHONY: postgres
postgres: ## Make sure PostgreSQL 15's server programs are installed (the reference balance system's tests start their own clusters).
	hack/ensure-postgres.sh

.PHONY: node-packages
node-packages: ## Make sure containerd, runc, the CNI plugins, iptables, conntrack and nft are installed (root).
	hack/ensure-node-packages.sh

.PHONY: chromium
chromium: ## Make sure Debian's chromium is installed (the rain page's browser tests; root).
	hack/ensure-chromium.sh

.PHONY: prometheus
prometheus: ## Make sure promtool (Debian's prometheus package) is installed, for the alert rule tests (root).
	hack/ensure-prometheus.sh

.PHONY: test
test: redis postgres node-packages chromium prometheus controlplane traefik ## Run every test: real Redis, a real PostgreSQL, a real API server, and a real node (as root).
	$(GO) test $(TEST_FLAGS) $$($(GO) list ./... | grep -v -e /test/e2e/node -e /test/e2e/upgrade)
	$(GO) test $(TEST_FLAGS) -p 1 -v ./test/e2e/node ./test/e2e/upgrade

.PHONY: test-unit
test-unit: ## Run the tests that need no server (go test -short): the controller's phase tables, pure rules, codecs. Seconds.
	$(GO) test -short -count=1 ./api/... ./controllers/... ./lua/... ./store/... ./test/history/ ./test/printed/ ./internal/... ./cmd/balance/ ./test/pgtest/ ./test/balancetest/ ./hack/release/

.PHONY: lint
lint: ## go vet and staticcheck (a Go tool pinned in go.mod).
	$(GO) vet ./...
	$(GO) tool staticcheck ./...

.PHONY: lint-manifests
lint-manifests: redis controlplane ## kubeconform (a Go tool pinned in go.mod) with schemas from the real API server, and kube-linter's default checks, on the rendered install and the grab workloads.
	$(GO) test -count=1 -run '^(TestManifestsPassKubeconform|TestManifestsPassLinterChecks|TestLintObjectFindsEachFault)$$' ./test/packaging/

.PHONY: verify
verify: ## Fail when generated files, formatting or go.mod/go.sum are not up to date.
	$(MAKE) manifests generate chart
	git diff --exit-code -- config/crd config/rbac api/v1alpha1/zz_generated.deepcopy.go \
		config/prometheus config/grafana config/argocd charts
	@test -z "$$(gofmt -l $$(git ls-files '*.go'))" || { gofmt -l $$(git ls-files '*.go'); echo "gofmt would change the files above"; exit 1; }
	$(GO) mod tidy -diff

##@ Build

.PHONY: build
build: ## Build the operator, the grab service, the kubectl plugin (kubectl-rpa) and the reference balance system into bin/ (static binaries, VERSION stamped in).
	CGO_ENABLED=0 $(GO) build -trimpath -ldflags "$(LDFLAGS)" -o bin/manager ./cmd/manager
	CGO_ENABLED=0 $(GO) build -trimpath -ldflags "$(LDFLAGS)" -o bin/grabsvc ./cmd/grabsvc
	CGO_ENABLED=0 $(GO) build -trimpath -ldflags "$(LDFLAGS)" -o bin/kubectl-rpa ./cmd/kubectl-rpa
	CGO_ENABLED=0 $(GO) build -trimpath -ldflags "$(LDFLAGS)" -o bin/balance ./cmd/balance

.PHONY: image
image: traefik ## Build the operator, pause, Redis, balance system and Traefik (Gateway) images into dist/ as tarballs, without Docker.
	$(GO) run ./hack/image --out dist --version $(VERSION) $(IMAGE_ARGS)

.PHONY: run
run: ## Run the operator against the current kubeconfig.
	$(GO) run ./cmd/manager $(ARGS)

.PHONY: demo
demo: redis postgres node-packages controlplane build ## A real node (or host processes), the operator, grab pods and a red-packet rain, settled into the reference balance system on a PostgreSQL of its own.
	$(GO) run ./hack/demo $(ARGS)

.PHONY: bench
bench: redis postgres controlplane build ## Measure the grab path against redis-benchmark and a no-op handler, and the reference balance system's grants against plain inserts on PostgreSQL; writes docs/benchmarks.md.
	$(GO) run ./hack/bench $(ARGS)

SOAK_RUNS ?= 200
SOAK_OPERATOR_RUNS ?= $(SOAK_RUNS)
SOAK_BUDGET_RUNS ?= 50
SOAK_BUDGET_LOSS_RUNS ?= 20
.PHONY: soak
soak: redis controlplane ## Check SOAK_RUNS (200) seeded rains under faults for linearizability with the stand-in controller, SOAK_OPERATOR_RUNS with the real one, SOAK_BUDGET_RUNS (50) runs of a budget's runtime packets and SOAK_BUDGET_LOSS_RUNS (20) that lose the budget's data; prints runs, operations, faults, violations, lost, real-controller restarts.
	HISTORY_RUNS=$(SOAK_RUNS) HISTORY_OPERATOR_RUNS=$(SOAK_OPERATOR_RUNS) HISTORY_BUDGET_RUNS=$(SOAK_BUDGET_RUNS) HISTORY_BUDGET_LOSS_RUNS=$(SOAK_BUDGET_LOSS_RUNS) $(GO) test -count=1 -timeout 60m \
		-run '^(TestRandomizedHistories|TestHistoriesWithOperator|TestBudgetHistories)$$' -v ./test/history/

##@ Deployment

.PHONY: render
render: ## Render the install manifests for image redpacket-operator:$(VERSION) into dist/install.yaml.
	GO=$(GO) hack/render-install.sh $(VERSION) dist/install.yaml

.PHONY: release
release: redis render image ## Everything a release ships, in dist/: install.yaml, the images, the Helm chart, kubectl-rpa for linux and darwin (amd64, arm64), each with a .sha256.
	$(GO) run ./hack/release --out dist --version $(VERSION)

.PHONY: deploy
deploy: render ## Render the manifests and apply them to the current cluster.
	$(KUBECTL) apply --server-side -f dist/install.yaml

.PHONY: undeploy
undeploy: render ## Delete what deploy applied.
	$(KUBECTL) delete --ignore-not-found -f dist/install.yaml

.PHONY: help
help: ## List the targets.
	@awk 'BEGIN {FS = ":.*##"} /^[a-z-]+:.*##/ { printf "  %-14s %s\n", $$1, $$2 } /^##@/ { printf "\n%s\n", substr($$0, 5) }' $(MAKEFILE_LIST)
