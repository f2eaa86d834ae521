//go:build tools

// Package tools pins the program this module builds, so that go mod tidy keeps its
// dependencies; scripts/build-control-plane.sh runs
// go build k8s.io/kubernetes/cmd/kube-apiserver here.
package tools

import _ "k8s.io/kubernetes/cmd/kube-apiserver"
