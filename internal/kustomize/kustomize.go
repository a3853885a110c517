// Package kustomize builds kustomize directories in process with the kustomize Go API,
// the same library (sigs.k8s.io/kustomize/api, at the version go.mod names) that
// kubectl kustomize embeds, so the install manifests and the chart are rendered
// without building kubectl first. The output is what kubectl kustomize prints for the
// same directory, byte for byte; test/packaging checks that.
package kustomize

import (
	"fmt"

	"sigs.k8s.io/kustomize/api/krusty"
	"sigs.k8s.io/kustomize/kyaml/filesys"
)

// Build builds the kustomization in dir (and everything it includes, which must
// lie under dir: kustomize's default load restrictions) and returns the rendered
// objects as one YAML stream, with kubectl kustomize's defaults: no plugins, no
// managed-by label, and the objects in the order the kustomization's sortOptions
// give, else in kustomize's legacy order (namespaces and definitions first), which is
// what kubectl kustomize does when --reorder is not given.
func Build(dir string) ([]byte, error) {
	options := krusty.MakeDefaultOptions()
	options.Reorder = krusty.ReorderOptionUnspecified
	kustomizer := krusty.MakeKustomizer(options)
	objects, err := kustomizer.Run(filesys.MakeFsOnDisk(), dir)
	if err != nil {
		return nil, fmt.Errorf("kustomize build %s: %w", dir, err)
	}
	stream, err := objects.AsYaml()
	if err != nil {
		return nil, fmt.Errorf("encoding the objects of %s: %w", dir, err)
	}
	return stream, nil
}
