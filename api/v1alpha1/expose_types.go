package v1alpha1

// Expose publishes the grab service of an activity or a budget outside the cluster,
// through exactly one of a Gateway API HTTPRoute attached to the platform's Gateway or
// a networking.k8s.io/v1 Ingress. The operator creates and owns the route or the
// Ingress (never a Gateway, never an IngressClass), and deletes it when expose is
// removed or switches kind. docs/operations.md "Exposure" describes it.
// +kubebuilder:validation:XValidation:rule="has(self.httpRoute) != has(self.ingress)",message="expose needs exactly one of httpRoute and ingress"
type Expose struct {
	// httpRoute attaches an HTTPRoute (gateway.networking.k8s.io/v1) to the
	// platform's Gateway. Where the Gateway API is not installed, Exposed is False
	// with reason GatewayAPIMissing and everything else goes on.
	// +optional
	HTTPRoute *HTTPRouteExpose `json:"httpRoute,omitempty"`

	// ingress makes a networking.k8s.io/v1 Ingress.
	// +optional
	Ingress *IngressExpose `json:"ingress,omitempty"`
}

// ParentReference names a Gateway (or a listener of one) the route attaches to: a
// subset of the Gateway API's ParentReference.
type ParentReference struct {
	// name of the Gateway.
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	Name string `json:"name"`

	// namespace of the Gateway. Absent means the route's own namespace; another
	// namespace's Gateway must allow routes from this one.
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=63
	// +optional
	Namespace string `json:"namespace,omitempty"`

	// sectionName names one listener of the Gateway. Absent means every listener
	// that accepts the route.
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	// +optional
	SectionName string `json:"sectionName,omitempty"`
}

// HTTPRouteExpose is an HTTPRoute to the grab Service.
type HTTPRouteExpose struct {
	// parentRefs are the Gateways the route attaches to; the platform runs them.
	// +kubebuilder:validation:MinItems=1
	// +kubebuilder:validation:MaxItems=8
	// +listType=atomic
	ParentRefs []ParentReference `json:"parentRefs"`

	// hostnames the route answers for. Absent means those of the Gateway's
	// listeners. The first is the one status.url names.
	// +kubebuilder:validation:MaxItems=16
	// +kubebuilder:validation:items:MinLength=1
	// +kubebuilder:validation:items:MaxLength=253
	// +kubebuilder:validation:items:Pattern=`^(\*\.)?[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$`
	// +listType=atomic
	// +optional
	Hostnames []string `json:"hostnames,omitempty"`

	// pathPrefix under which the grab API, the rain page and its assets are served.
	// The grab service sees the path unchanged, so anything but "/" needs the
	// Gateway to strip it or the page to be reached at "/". Defaults to "/".
	// +kubebuilder:default="/"
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=256
	// +kubebuilder:validation:Pattern=`^/[-A-Za-z0-9._~/]*$`
	// +optional
	PathPrefix string `json:"pathPrefix,omitempty"`
}

// IngressExpose is a networking.k8s.io/v1 Ingress to the grab Service.
type IngressExpose struct {
	// className is the IngressClass. Absent means the cluster's default class.
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	// +optional
	ClassName string `json:"className,omitempty"`

	// host the Ingress answers for.
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	// +kubebuilder:validation:Pattern=`^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$`
	Host string `json:"host"`

	// tlsSecretName names the Secret, in the same namespace, that holds the host's
	// certificate (or that cert-manager fills, through annotations). Absent means
	// plain HTTP: status.url is then http://.
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	// +optional
	TLSSecretName string `json:"tlsSecretName,omitempty"`

	// annotations are put on the Ingress as they are, e.g.
	// cert-manager.io/cluster-issuer or the controller's own settings.
	// +kubebuilder:validation:MaxProperties=32
	// +kubebuilder:validation:XValidation:rule="self.all(k, size(k) <= 317 && size(self[k]) <= 4096)",message="an annotation key is at most 317 characters and its value at most 4096"
	// +optional
	Annotations map[string]string `json:"annotations,omitempty"`
}

// ConditionExposed says whether the grab service is reachable from outside through
// spec.expose: for an HTTPRoute, True once every parent Gateway accepted the route
// and its backend resolved (RouteAccepted), False with the parent's own reason and
// message when one refused it (e.g. NotAllowedByListeners), Unknown while no parent
// has reported (RoutePending); for an Ingress, True once its load balancer has an
// address (AddressAssigned, the address in the message), Unknown before
// (AddressPending). False with GatewayAPIMissing where the Gateway API is not
// installed, ExposeFailed when the object could not be written, NotAdopted when an
// object of its name is not the operator's. Absent without spec.expose.
const ConditionExposed = "Exposed"

// Reasons of ConditionExposed (a refusing parent's reason is carried as it is).
const (
	// ReasonRouteAccepted: every parent accepted the route and its refs resolved.
	ReasonRouteAccepted = "RouteAccepted"
	// ReasonRoutePending: the route is applied; not every parent has reported on it.
	ReasonRoutePending = "RoutePending"
	// ReasonAddressAssigned: the Ingress's load balancer has an address.
	ReasonAddressAssigned = "AddressAssigned"
	// ReasonAddressPending: the Ingress is applied; its load balancer has no
	// address yet.
	ReasonAddressPending = "AddressPending"
	// ReasonGatewayAPIMissing: spec.expose.httpRoute is set and the cluster serves
	// no gateway.networking.k8s.io/v1 HTTPRoute; the operator looks again
	// periodically.
	ReasonGatewayAPIMissing = "GatewayAPIMissing"
	// ReasonExposeFailed: the route or Ingress could not be applied or read.
	ReasonExposeFailed = "ExposeFailed"
)
