package v1alpha1_test

import (
	"flag"
	"fmt"
	"os"
	"testing"

	"redpacket.io/operator/test/controlplane"
)

// cp is the package's one control plane: a real kube-apiserver and etcd with the
// generated CRD installed, shared by every test here that needs one. Under -short it
// is not started, and those tests skip (needsControlPlane).
var cp *controlplane.ControlPlane

func TestMain(m *testing.M) {
	flag.Parse()
	if testing.Short() {
		os.Exit(m.Run())
	}
	var err error
	cp, err = controlplane.New()
	if err != nil {
		fmt.Fprintf(os.Stderr, "control plane: %v\n", err)
		os.Exit(1)
	}
	code := m.Run()
	if err := cp.Stop(); err != nil {
		fmt.Fprintf(os.Stderr, "stopping the control plane: %v\n", err)
	}
	os.Exit(code)
}

// needsControlPlane skips the test under -short, where no control plane runs. Every
// test that uses cp calls it first.
func needsControlPlane(t *testing.T) {
	t.Helper()
	if testing.Short() {
		t.Skip("needs kube-apiserver and etcd; run without -short")
	}
}
