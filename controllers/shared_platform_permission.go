package controllers

import (
	"context"
	"fmt"
	"strings"

	authorizationv1 "k8s.io/api/authorization/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
)

// A platform decision is an annotation that only the platform team may set: the
// acceptance of a rolled-back Redis state, and the abandon of a held deletion. The
// admission policy config/policy/platform_annotations_policy.yaml admits it only from
// a user allowed the decision's custom verb on the activity, who names themselves in
// the decision's "by" annotation. The controller does not take the policy's presence
// for granted: before it acts on a decision it asks the API server, with a
// SubjectAccessReview, whether the recorded user (with the recorded groups, if any)
// holds the verb on this activity, and refuses when not. Without the policy that
// check still stops a tenant who names themselves, or names nobody; only a tenant who
// writes a platform user's name into the "by" annotation gets past it, which the
// policy prevents.
type platformDecision struct {
	// verb is the custom verb on redpacketactivities (or redpacketbudgets) the
	// decision needs.
	verb string
	// by and groups are the annotations that name who decided.
	by, groups string
}

var (
	acceptDecision = platformDecision{verb: redpacketv1alpha1.VerbAcceptRedisState,
		by: redpacketv1alpha1.AnnotationAcceptedBy, groups: redpacketv1alpha1.AnnotationAcceptedByGroups}
	abandonDecision = platformDecision{verb: redpacketv1alpha1.VerbAbandon,
		by: redpacketv1alpha1.AnnotationAbandonedBy, groups: redpacketv1alpha1.AnnotationAbandonedByGroups}
)

// accessReviewer answers whether a user may use a verb on an activity or a budget.
type accessReviewer interface {
	// allowed reports whether user, in groups, may use verb on obj, a resource of
	// the redpacket.io group (redpacketactivities or redpacketbudgets), and the
	// authorizer's reason when it says no.
	allowed(ctx context.Context, obj client.Object, resource, verb, user string, groups []string) (bool, string, error)
}

// subjectAccessReviewer asks the API server with a SubjectAccessReview.
type subjectAccessReviewer struct {
	c client.Client
}

// +kubebuilder:rbac:groups=authorization.k8s.io,resources=subjectaccessreviews,verbs=create

func (s subjectAccessReviewer) allowed(ctx context.Context, obj client.Object, resource, verb, user string, groups []string) (bool, string, error) {
	review := &authorizationv1.SubjectAccessReview{Spec: authorizationv1.SubjectAccessReviewSpec{
		User:   user,
		Groups: groups,
		ResourceAttributes: &authorizationv1.ResourceAttributes{
			Namespace: obj.GetNamespace(),
			Verb:      verb,
			Group:     redpacketv1alpha1.GroupVersion.Group,
			Resource:  resource,
			Name:      obj.GetName(),
		},
	}}
	if err := s.c.Create(ctx, review); err != nil {
		return false, "", fmt.Errorf("asking whether %s may %s %s/%s: %w", user, verb, resource, obj.GetName(), err)
	}
	return review.Status.Allowed && !review.Status.Denied, review.Status.Reason, nil
}

// reviewerOr is the access reviewer of a reconciler: set, when it is not nil (the
// phase tests), else the API server through c.
func reviewerOr(set accessReviewer, c client.Client) accessReviewer {
	if set != nil {
		return set
	}
	return subjectAccessReviewer{c: c}
}

// decidedBy checks a platform decision on the activity (platformDecidedBy).
func (r *RedPacketActivityReconciler) decidedBy(ctx context.Context, a *redpacketv1alpha1.RedPacketActivity, d platformDecision) (user, refused string, err error) {
	return platformDecidedBy(ctx, reviewerOr(r.access, r.Client), a, "redpacketactivities", d)
}

// platformDecidedBy checks a platform decision on obj, a resource of kind resource
// (redpacketactivities or redpacketbudgets): who the annotations say made it, and
// whether that user may. It returns the user, and when the decision does not stand,
// why not in a sentence (user then may be empty). An error means the API server
// could not be asked; nothing is decided then.
func platformDecidedBy(ctx context.Context, reviewer accessReviewer, obj client.Object, resource string, d platformDecision) (user, refused string, err error) {
	annotations := obj.GetAnnotations()
	user = strings.TrimSpace(annotations[d.by])
	if user == "" {
		return "", fmt.Sprintf("the annotation %s does not name who decided; the platform team sets it to their user name with the decision", d.by), nil
	}
	var groups []string
	if g := strings.TrimSpace(annotations[d.groups]); g != "" {
		for _, group := range strings.Split(g, ",") {
			if group = strings.TrimSpace(group); group != "" {
				groups = append(groups, group)
			}
		}
	}
	ok, reason, err := reviewer.allowed(ctx, obj, resource, d.verb, user, groups)
	if err != nil {
		return user, "", err
	}
	if !ok {
		msg := fmt.Sprintf("%s may not %s %s/%s in namespace %s (the redpacket-platform ClusterRole grants it)",
			user, d.verb, resource, obj.GetName(), obj.GetNamespace())
		if reason != "" {
			msg += ": " + reason
		}
		return user, msg, nil
	}
	return user, "", nil
}
