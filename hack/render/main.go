// Command render prints the objects of a kustomize directory, as kubectl kustomize
// does, without kubectl (package internal/kustomize):
//
//	go run ./hack/render DIR     (hack/render-install.sh, make render)
package main

import (
	"fmt"
	"os"

	"redpacket.io/operator/internal/kustomize"
)

func main() {
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: render DIR")
		os.Exit(2)
	}
	stream, err := kustomize.Build(os.Args[1])
	if err != nil {
		fmt.Fprintln(os.Stderr, "render:", err)
		os.Exit(1)
	}
	if _, err := os.Stdout.Write(stream); err != nil {
		fmt.Fprintln(os.Stderr, "render:", err)
		os.Exit(1)
	}
}
