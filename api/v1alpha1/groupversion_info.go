// Package v1alpha1 holds the RedPacketActivity API of the redpacket.io group.
// +kubebuilder:object:generate=true
// +groupName=redpacket.io
package v1alpha1

import (
	"k8s.io/apimachinery/pkg/runtime/schema"
	"sigs.k8s.io/controller-runtime/pkg/scheme"
)

var (
	// GroupVersion is the group and version of every kind in this package.
	GroupVersion = schema.GroupVersion{Group: "redpacket.io", Version: "v1alpha1"}

	// SchemeBuilder registers this package's kinds with a runtime scheme.
	//lint:ignore SA1019 controller-gen's scaffold registers kinds this way; the operator already depends on controller-runtime.
	SchemeBuilder = &scheme.Builder{GroupVersion: GroupVersion}

	// AddToScheme adds this package's kinds to a scheme.
	AddToScheme = SchemeBuilder.AddToScheme
)
