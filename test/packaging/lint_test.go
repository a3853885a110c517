package packaging

import (
	"path/filepath"
	"testing"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
)

// The operator's replicas are spread over nodes (what kube-linter's
// no-anti-affinity check asks): the Deployment that make render and the chart give
// has a topology spread over kubernetes.io/hostname whose selector picks its own pods.
func TestOperatorReplicasSpreadOverNodes(t *testing.T) {
	fromChart, err := renderChart(loadChart(t), nil)
	if err != nil {
		t.Fatalf("rendering the chart: %v", err)
	}
	for source, objs := range map[string][]*unstructured.Unstructured{
		"make render": kustomize(t, filepath.Join(root, "config", "default")),
		"the chart":   fromChart,
	} {
		var found bool
		for _, o := range objs {
			if o.GetKind() != "Deployment" {
				continue
			}
			found = true
			rawReplicas, _, _ := unstructured.NestedFieldNoCopy(o.Object, "spec", "replicas")
			replicas, _ := rawReplicas.(float64) // decoded from YAML as JSON numbers
			podLabels, _, _ := unstructured.NestedStringMap(o.Object, "spec", "template", "metadata", "labels")
			spreads, _, _ := unstructured.NestedSlice(o.Object, "spec", "template", "spec", "topologySpreadConstraints")
			ok := false
			for _, s := range spreads {
				m, _ := s.(map[string]any)
				key, _, _ := unstructured.NestedString(m, "topologyKey")
				sel, _, _ := unstructured.NestedStringMap(m, "labelSelector", "matchLabels")
				selects := len(sel) > 0
				for k, v := range sel {
					if podLabels[k] != v {
						selects = false
					}
				}
				if key == "kubernetes.io/hostname" && selects {
					ok = true
				}
			}
			if replicas < 2 || !ok {
				t.Errorf("%s: Deployment %s has %v replicas and spreads %v over its pods labelled %v; want 2+ replicas spread over kubernetes.io/hostname",
					source, o.GetName(), replicas, spreads, podLabels)
			}
		}
		if !found {
			t.Errorf("%s renders no Deployment", source)
		}
	}
}
