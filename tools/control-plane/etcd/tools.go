//go:build tools

// Package tools pins the program this module builds, so that go mod tidy keeps its
// dependencies; scripts/build-control-plane.sh runs go build go.etcd.io/etcd/server/v3 here.
package tools

import _ "go.etcd.io/etcd/server/v3"
