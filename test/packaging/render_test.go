package packaging

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	inprocess "redpacket.io/operator/internal/kustomize"
)

// Every kustomization under config/ renders in process (internal/kustomize, which
// make render and make chart use) to exactly the bytes bin/kubectl kustomize prints
// for it, so dropping kubectl from make render changes nothing anyone receives.
func TestInProcessKustomizeIsKubectlKustomize(t *testing.T) {
	kubectl := kubectlBin(t)
	var dirs []string
	err := filepath.WalkDir(filepath.Join(root, "config"), func(path string, d os.DirEntry, err error) error {
		if err == nil && d.Name() == "kustomization.yaml" {
			dirs = append(dirs, filepath.Dir(path))
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(dirs) < 8 {
		t.Fatalf("found %d kustomizations under config/, want at least 8: %v", len(dirs), dirs)
	}
	for _, dir := range dirs {
		rel, _ := filepath.Rel(root, dir)
		t.Run(rel, func(t *testing.T) {
			var stderr bytes.Buffer
			cmd := exec.Command(kubectl, "kustomize", dir)
			cmd.Stderr = &stderr
			want, err := cmd.Output()
			if err != nil {
				t.Fatalf("kubectl kustomize %s: %v\n%s", rel, err, stderr.String())
			}
			got, err := inprocess.Build(dir)
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, want) {
				t.Errorf("%s: in process %d bytes, kubectl kustomize %d bytes; first difference at line %d",
					rel, len(got), len(want), firstDifferentLine(got, want))
			}
		})
	}
}

// make render needs no control plane: hack/render-install.sh renders the install in
// a copy of the tree that has no bin/ at all (config/, the render command and the
// module files only), and gives what it gives in the repository.
func TestRenderInstallNeedsNoKubectl(t *testing.T) {
	tree := t.TempDir()
	for _, path := range []string{"go.mod", "go.sum", "hack/render-install.sh", "hack/render", "internal/kustomize", "config"} {
		copyTree(t, filepath.Join(root, path), filepath.Join(tree, path))
	}
	if _, err := os.Stat(filepath.Join(tree, "bin")); !os.IsNotExist(err) {
		t.Fatalf("the copy has a bin/: %v", err)
	}
	render := func(dir string) []byte {
		out := filepath.Join(t.TempDir(), "install.yaml")
		cmd := exec.Command(filepath.Join(dir, "hack", "render-install.sh"), "v9.9.9", out)
		if b, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("hack/render-install.sh in %s: %v\n%s", dir, err, b)
		}
		b, err := os.ReadFile(out)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	got, want := render(tree), render(root)
	if !bytes.Equal(got, want) {
		t.Errorf("rendered without bin/: %d bytes, in the repository: %d bytes; first difference at line %d",
			len(got), len(want), firstDifferentLine(got, want))
	}
	if !bytes.Contains(got, []byte("redpacket-operator:v9.9.9")) {
		t.Error("the rendered install does not name the image redpacket-operator:v9.9.9")
	}
}

// firstDifferentLine is the 1-based number of the first line where a and b differ.
func firstDifferentLine(a, b []byte) int {
	al, bl := strings.Split(string(a), "\n"), strings.Split(string(b), "\n")
	for i := range min(len(al), len(bl)) {
		if al[i] != bl[i] {
			return i + 1
		}
	}
	return min(len(al), len(bl)) + 1
}

// copyTree copies a file or a directory, keeping file modes.
func copyTree(t *testing.T, from, to string) {
	t.Helper()
	err := filepath.WalkDir(from, func(path string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(from, path)
		dst := filepath.Join(to, rel)
		info, err := d.Info()
		if err != nil {
			return err
		}
		if d.IsDir() {
			return os.MkdirAll(dst, 0o755)
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
			return err
		}
		return os.WriteFile(dst, b, info.Mode().Perm())
	})
	if err != nil {
		t.Fatalf("copying %s: %v", from, err)
	}
}

// config/dev-redis applies after an install that created the operator's namespace
// without kubectl's last-applied-configuration annotation (helm install
// --create-namespace, a server-side apply, a plain create: here the last) and prints
// no warning: it does not declare the namespace. Applied twice, it changes nothing.
func TestDevRedisAppliesAfterAnInstallWithoutWarnings(t *testing.T) {
	e := startLive(t)
	ns := &corev1.Namespace{}
	if err := e.client.Get(t.Context(), client.ObjectKey{Name: "redpacket-system"}, ns); err != nil {
		t.Fatalf("the operator's namespace: %v", err)
	}
	if _, ok := ns.Annotations["kubectl.kubernetes.io/last-applied-configuration"]; ok {
		t.Fatal("the namespace carries kubectl's annotation; the test needs one created otherwise")
	}
	for i := range 2 {
		var stdout, stderr bytes.Buffer
		cmd := exec.Command(kubectlBin(t), "--kubeconfig", e.kubeconfig, "apply", "-k", filepath.Join(root, "config", "dev-redis"))
		cmd.Stdout, cmd.Stderr = &stdout, &stderr
		if err := cmd.Run(); err != nil {
			t.Fatalf("kubectl apply -k config/dev-redis: %v\n%s%s", err, stdout.String(), stderr.String())
		}
		if strings.Contains(stderr.String(), "Warning") || strings.Contains(stderr.String(), "last-applied-configuration") {
			t.Errorf("apply %d warned:\n%s", i+1, stderr.String())
		}
		if strings.Contains(stdout.String(), "namespace/") {
			t.Errorf("apply %d touched a namespace:\n%s", i+1, stdout.String())
		}
		t.Logf("apply %d:\n%s", i+1, stdout.String())
	}
	t.Cleanup(func() {
		_ = exec.Command(kubectlBin(t), "--kubeconfig", e.kubeconfig, "delete", "-k", filepath.Join(root, "config", "dev-redis")).Run()
	})
}
