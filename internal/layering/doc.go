// Package layering holds the test of the project's layers: the reconcilers
// (controllers) and the tenant-side grab service (grabsvc) reach Redis through the
// store's handles alone. Neither issues a Redis command of its own nor imports the
// Lua scripts (package lua, but for its split, lua/split, which is plain Go), and
// the grab service does not import the operator's settlement. It has no code.
package layering
