package controllers

import (
	"context"
	"errors"
	"fmt"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"sigs.k8s.io/controller-runtime/pkg/client"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/controllers/specs"
	"redpacket.io/operator/store"
	"redpacket.io/operator/store/redisconn"
)

// An activity on the operator's default Redis gets a Redis ACL user of its own
// (store.Shard.EnsureUser): its grab pods log in as that user, which may touch only
// the activity's keys and run only what the grab service needs, so the operator's
// own Redis credentials never leave the operator's namespace. The user's name and
// password are in the Secret <activity>-grab-redis, next to the default Redis's
// addresses. Deleting that Secret rotates the password; deleting the activity
// removes the user. An activity with spec.redis brings its own credentials, and no
// user is made for it.

// usersOnDefaultRedis returns the manager of the activity's ACL user on the default
// Redis: its store there (storeFor), which manages users too.
func (r *RedPacketActivityReconciler) usersOnDefaultRedis(a *redpacketv1alpha1.RedPacketActivity) (redisUsers, error) {
	conn, err := r.defaultRedisConn()
	if err != nil {
		return nil, err
	}
	return r.storeFor(conn, a), nil
}

// reconcileRedisUser settles how the grab pods reach Redis, just before the grab
// workload step applies them; it acts only on a workload the grab workload
// ownership step found the activity's to touch (s.grabOwned), as the grab workload
// step does.
//
// An activity without spec.redis gets its own user on the operator's default Redis
// (activityRedisLogin) and the Secret <activity>-grab-redis that carries the user's
// password, applied under FieldManager when its data differs. The user and the
// Secret are one step because the Secret is the only copy of the password: when the
// step succeeds, Redis holds the user with exactly the password the Secret holds,
// and the grab workload step puts the digest of that login on the pod template
// (s.defaultRedisLogin). When the default Redis cannot give the activity a user,
// Ready is False with RedisACLUnavailable and nothing is applied; when it does not
// answer, Ready is False with RedisUnavailable and the step is retried.
//
// An activity with spec.redis brings its own credentials: a user it had on the
// default Redis is removed, and its <activity>-grab-redis deleted.
//
// Like the grab workload step it keeps the chain going when it fails: closing at
// endTime and refunding never wait on a Redis user. Until it succeeds, the grab
// workload step applies nothing (s.grabRedisSettled).
func (r *RedPacketActivityReconciler) reconcileRedisUser(ctx context.Context, s *activityScope) (stepResult, error) {
	if !s.grabOwned {
		return stepResult{}, nil
	}
	a := s.activity
	existing := s.grabRedisSecret
	if a.Spec.Redis != nil {
		if existing != nil {
			// The activity names its own Secret now; its user on the default Redis and
			// the Secret with its credentials are not needed any more.
			if err := r.deleteActivityRedisUser(ctx, a); err != nil {
				return stepResult{}, err
			}
			if err := r.Client.Delete(ctx, existing, client.Preconditions{UID: &existing.UID}); err != nil && !apierrors.IsNotFound(err) {
				return stepResult{}, fmt.Errorf("deleting secret %s: %w", existing.Name, err)
			}
		}
		s.grabRedisSettled = true
		return stepResult{}, nil
	}
	login, res, err := r.activityRedisLogin(ctx, s, existing)
	if err != nil || login == nil {
		return res, err
	}
	if existing == nil || !secretDataEqual(existing.Data, login.SecretData()) {
		if res, err := r.applyGrabObject(ctx, specs.GrabRedisSecret(a, *login), FieldManager); err != nil {
			return res, err
		}
	}
	s.defaultRedisLogin = login
	s.grabRedisSettled = true
	return stepResult{}, nil
}

// activityRedisLogin returns the login of <activity>-grab-redis for an activity
// on the default Redis: the default Redis's addresses, mode and TLS setting, with the
// activity's own user (store.Activity.UserName) and password, never the operator's. It
// first makes Redis hold that user with that password (EnsureUser, at every
// reconcile, so a Redis that restarted without an ACL file, or a cluster node that
// joined, gets it back).
//
// The password is the one existing (the Secret as it is, nil when there is none)
// holds for the activity's user. When there is no Secret, which is how a rotation is
// asked for, or it holds something else (an older operator's copy of its own
// credentials), the password is a new random one: EnsureUser then replaces the user,
// which closes every connection made with the old password, and the new Secret's
// digest in specs.AnnotationRedisCredentials rolls the grab pods.
//
// When the default Redis cannot give the activity a user (store.ErrACLUnavailable) it
// returns no login and a result whose blocker (Ready False, RedisACLUnavailable) says
// so, without halting the chain; it deletes an existing Secret that holds the
// operator's own credentials. The caller then applies no workload.
func (r *RedPacketActivityReconciler) activityRedisLogin(ctx context.Context, s *activityScope, existing *corev1.Secret) (*specs.RedisLogin, stepResult, error) {
	a := s.activity
	conn, err := r.defaultRedisConn()
	if err != nil {
		return nil, blocked(redpacketv1alpha1.ReasonRedisConfigInvalid, "%v", err), err
	}
	users, err := r.usersOnDefaultRedis(a)
	if err != nil {
		return nil, stepResult{}, err
	}
	user := users.UserName()
	password, err := loginPassword(existing, user)
	if err != nil {
		return nil, stepResult{}, err
	}

	rctx, cancel := r.redisContext(ctx)
	defer cancel()
	change, err := users.EnsureUser(rctx, password)
	switch {
	case errors.Is(err, store.ErrACLUnavailable):
		if err := r.deleteOperatorCredentials(ctx, existing); err != nil {
			return nil, stepResult{}, err
		}
		return nil, stepResult{blocker: notReady(redpacketv1alpha1.ReasonRedisACLUnavailable,
			"the operator's default Redis cannot give the activity a Redis user of its own: %v. The grab service is not "+
				"deployed, so that the operator's own Redis credentials never reach this namespace; use Redis 6 or later "+
				"with an operator user that may manage ACL users, or give the activity its own Redis with spec.redis",
			store.ErrACLUnavailable)}, nil
	case err != nil:
		return nil, blocked(redpacketv1alpha1.ReasonRedisUnavailable, "setting up the activity's Redis user: %v", err),
			fmt.Errorf("setting up the activity's Redis user: %w", err)
	}
	if change.Set > 0 {
		r.logger(ctx).Info("set the activity's Redis user", "user", user, "nodes", change.Nodes, "set", change.Set,
			"rotated", change.Rotated)
	}
	return defaultRedisLogin(conn, user, password), stepResult{}, nil
}

// deleteOperatorCredentials deletes secret (the activity's <activity>-grab-redis)
// when it holds the operator's own Redis user and password, as operators before
// per-activity users wrote it. nil is nothing to do.
func (r *RedPacketActivityReconciler) deleteOperatorCredentials(ctx context.Context, secret *corev1.Secret) error {
	if secret == nil || string(secret.Data[redisconn.SecretUsername]) != r.DefaultRedis.Username ||
		string(secret.Data[redisconn.SecretPassword]) != r.DefaultRedis.Password {
		return nil
	}
	if err := r.Client.Delete(ctx, secret, client.Preconditions{UID: &secret.UID}); err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("deleting secret %s, which holds the operator's Redis credentials: %w", secret.Name, err)
	}
	return nil
}

// deleteActivityRedisUser removes the activity's ACL user from the default Redis:
// when the activity is gone, or names its own Redis now. A Redis that cannot manage
// users cannot have been given one, so that is no error.
func (r *RedPacketActivityReconciler) deleteActivityRedisUser(ctx context.Context, a *redpacketv1alpha1.RedPacketActivity) error {
	users, err := r.usersOnDefaultRedis(a)
	if err != nil {
		return err
	}
	rctx, cancel := r.redisContext(ctx)
	defer cancel()
	n, err := users.DeleteUser(rctx)
	if err != nil && !errors.Is(err, store.ErrACLUnavailable) {
		return fmt.Errorf("removing the activity's Redis user: %w", err)
	}
	if n > 0 {
		r.logger(ctx).Info("removed the activity's Redis user", "user", users.UserName(), "nodes", n)
	}
	return nil
}
