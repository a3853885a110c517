package controllers

import (
	"fmt"
	"time"

	"k8s.io/client-go/tools/events"
	"k8s.io/client-go/util/workqueue"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"
)

// reconcilerWiring points at what both reconcilers take from the manager when it is
// left nil: the client, the API reader, the event recorder, the clock and the Redis
// access.
type reconcilerWiring struct {
	client   *client.Client
	reader   *client.Reader
	recorder *events.EventRecorder
	now      *func() time.Time
	access   **RedisAccess
}

// fill fills what is nil from mgr; a nil Redis access is made from o, and the access
// is set up with mgr (RedisAccess.SetupWithManager), once for both reconcilers when
// they share it.
func (w reconcilerWiring) fill(mgr ctrl.Manager, o Options) error {
	if *w.client == nil {
		*w.client = mgr.GetClient()
	}
	if *w.reader == nil {
		*w.reader = mgr.GetAPIReader()
	}
	if *w.recorder == nil {
		*w.recorder = mgr.GetEventRecorder(EventReporter)
	}
	if *w.now == nil {
		*w.now = time.Now
	}
	if *w.access == nil {
		*w.access = NewRedisAccess(o)
	}
	if err := (*w.access).SetupWithManager(mgr); err != nil {
		return fmt.Errorf("setting up the %s controller's Redis access: %w", o.Name, err)
	}
	return nil
}

// controllerOptions are the workqueue settings of either controller: o's
// concurrency, name validation, and an exponential backoff from 100ms to
// o.MaxBackoff after errors.
func (o Options) controllerOptions() controller.Options {
	skip := o.SkipNameValidation
	return controller.Options{
		MaxConcurrentReconciles: o.MaxConcurrentReconciles,
		SkipNameValidation:      &skip,
		RateLimiter: workqueue.NewTypedItemExponentialFailureRateLimiter[reconcile.Request](
			100*time.Millisecond, o.MaxBackoff),
	}
}
