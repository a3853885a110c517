//go:build tools

// Package traefik only records the Traefik proxy command built from this module.
package traefik

import _ "github.com/traefik/traefik/v3/cmd/traefik"
