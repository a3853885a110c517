// Package faults breaks the Redis under a running grab service and checks the money
// from outside: real redis-server processes killed with SIGKILL, replicas promoted
// while they lag, servers restarted from an older RDB copy, while clients grab
// through the real HTTP grab path (grabsvc.NewServer) with many users at once.
//
// Every test counts, from what the clients were told and what Redis holds
// afterwards: the grants acknowledged (a user was answered 200 with a packet), the
// acknowledged grants lost (not in the claims hash or the settlement stream), and
// the regrants (a packet acknowledged to two users, a user acknowledged two packets,
// or Redis holding either). The package has only tests; see docs/operations.md,
// "Fault tests", for what each one shows.
package faults
