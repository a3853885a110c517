package v1alpha1_test

import (
	"fmt"
	"os"
	"testing"

	"redpacket.io/operator/test/controlplane"
)

// cp is the package's one control plane: a real kube-apiserver and etcd with the
// generated CRD installed, shared by every test here.
var cp *controlplane.ControlPlane

func TestMain(m *testing.M) {
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
