// Package packaging tests what ships beside the code: the Helm chart (rendered with
// the Helm library and compared with what kustomize renders from config/ for the
// same settings), the alert rules (promtool test rules), the Grafana dashboard
// (every query names a metric that a real manager and a real grab service export),
// and the Argo CD health check (run in gopher-lua against status objects of real
// activities). The last two start a control plane, a redis-server, the manager and
// grab services as processes (live.go), once for the package.
package packaging

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/go-logr/logr"
	ctrllog "sigs.k8s.io/controller-runtime/pkg/log"

	"redpacket.io/operator/test/controlplane"
)

// root is the repository's top directory.
var root string

func TestMain(m *testing.M) {
	ctrllog.SetLogger(logr.Discard())
	var err error
	if root, err = controlplane.Root(); err != nil {
		fmt.Fprintln(os.Stderr, "packaging:", err)
		os.Exit(1)
	}
	code := m.Run()
	stopLive()
	os.Exit(code)
}

// kubectlBin is the kubectl that hack/build-controlplane.sh builds; the tests that
// render with kustomize need it.
func kubectlBin(t *testing.T) string {
	t.Helper()
	p := filepath.Join(root, "bin", "kubectl")
	if _, err := os.Stat(p); err != nil {
		t.Fatalf("%s is missing: run make controlplane", p)
	}
	return p
}
