//go:build tools

// Package etcd only records the etcd command built from this module.
package etcd

import _ "go.etcd.io/etcd/server/v3/etcdmain"
