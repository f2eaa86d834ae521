#!/usr/bin/env bash
# Build a Kubernetes control plane (kube-apiserver and etcd) once per machine into a cache outside
# the clone, and print the folder that holds both binaries.
#
# Both come from the Go module proxy through the wrapper modules under tools/control-plane/ (their
# go.mod and go.sum are committed; the binaries never are): kube-apiserver from k8s.io/kubernetes
# (tools/control-plane/kube-apiserver, one replace line per staging module) and etcd from
# go.etcd.io/etcd/server/v3 (tools/control-plane/etcd). The build runs into a temporary folder and
# is renamed into place when complete, under a lock (as scripts/llama-server.sh does).
#
# usage: scripts/build-control-plane.sh [--path]
#   (no argument)  build when the cache lacks it, then print the folder's path as the last line
#   --path         print the folder's path when it is built; exit 1 with a notice when it is not
# environment: BATCHPILOT_CACHE_DIR (default ~/.cache/batchpilot), CONTROL_PLANE_JOBS (go build -p;
#   default: the number of cores)
set -euo pipefail

version=v1.37.2
here=$(cd "$(dirname "$0")/.." && pwd)
modules=$here/tools/control-plane
cache_root=${BATCHPILOT_CACHE_DIR:-$HOME/.cache/batchpilot}/control-plane
cache=$cache_root/$version

if [ "${1:-}" = "--path" ]; then
  if [ -f "$cache/.complete" ] && [ -x "$cache/kube-apiserver" ] && [ -x "$cache/etcd" ]; then
    echo "$cache"
    exit 0
  fi
  echo "control-plane: not built at $cache; run 'make control-plane' (once per machine)" >&2
  exit 1
fi
if [ $# -gt 0 ]; then
  echo "usage: scripts/build-control-plane.sh [--path]" >&2
  exit 2
fi

if ! command -v go >/dev/null 2>&1; then
  echo "control-plane: 'go' is not on PATH; kube-apiserver and etcd are built from Go modules" \
    "(Go 1.26 or newer, with the Go module proxy reachable)" >&2
  exit 1
fi

mkdir -p "$cache_root"
exec 9>"$cache.lock"
flock 9
if [ ! -f "$cache/.complete" ]; then
  start=$(date +%s)
  jobs=${CONTROL_PLANE_JOBS:-$(nproc)}
  echo "control-plane: building kube-apiserver $version and etcd into $cache" \
    "(once per machine; $(go version | cut -d' ' -f3), -p $jobs, GOPROXY=$(go env GOPROXY))"
  rm -rf "$cache.partial"
  mkdir -p "$cache.partial"
  build() { # name, module folder, package, extra -ldflags
    local name=$1 dir=$2 package=$3 ldflags="-s -w ${4:-}" t0 log
    t0=$(date +%s)
    log=$cache.partial/$name-build.log
    echo "control-plane: [$name] downloading the modules of $dir (go mod download)"
    if ! (cd "$dir" && go mod download) >"$log" 2>&1; then
      echo "control-plane: [$name] a module could not be downloaded from the Go module proxy:" >&2
      grep -E 'reading|not available|404|403|410|dial|proxy' "$log" >&2 || tail -n 30 "$log" >&2
      exit 1
    fi
    echo "control-plane: [$name] compiling $package"
    # -trimpath: the binary does not name this machine's paths. CGO off: one static file.
    if ! (cd "$dir" && CGO_ENABLED=0 nice -n 10 go build -p "$jobs" -trimpath -mod=readonly \
      -ldflags="$ldflags" -o "$cache.partial/$name" "$package") >>"$log" 2>&1; then
      echo "control-plane: [$name] the build failed; the end of its log:" >&2
      tail -n 60 "$log" >&2
      exit 1
    fi
    echo "control-plane: [$name] built in $(( $(date +%s) - t0 )) s" \
      "($(du -h "$cache.partial/$name" | cut -f1))"
  }
  build etcd "$modules/etcd" go.etcd.io/etcd/server/v3
  # The version stamp that Kubernetes' own build (hack/lib/version.sh) sets: without it the server
  # calls itself v0.0.0-master, and helm refuses a chart whose kubeVersion it does not meet.
  stamp=""
  for key in gitVersion=$version gitMajor=1 gitMinor=$(echo "$version" | cut -d. -f2) \
    gitTreeState=clean buildDate=$(date -u +%Y-%m-%dT%H:%M:%SZ); do
    stamp+=" -X k8s.io/component-base/version.$key -X k8s.io/client-go/pkg/version.$key"
  done
  build kube-apiserver "$modules/kube-apiserver" k8s.io/kubernetes/cmd/kube-apiserver "$stamp"
  elapsed=$(( $(date +%s) - start ))
  printf 'kube-apiserver %s (k8s.io/kubernetes)\netcd %s (go.etcd.io/etcd/server/v3)\n%s\nbuild seconds %s (-p %s)\n' \
    "$version" "$(cd "$modules/etcd" && go list -m -f '{{.Version}}' go.etcd.io/etcd/server/v3)" \
    "$(go version)" "$elapsed" "$jobs" >"$cache.partial/BUILD-INFO"
  touch "$cache.partial/.complete"
  rm -rf "$cache"
  mv "$cache.partial" "$cache"
  echo "control-plane: built in $elapsed s"
else
  echo "control-plane: reusing $cache ($(grep 'build seconds' "$cache/BUILD-INFO" || true))"
fi
flock -u 9
"$cache/kube-apiserver" --version >/dev/null 2>&1 \
  || { echo "control-plane: $cache/kube-apiserver does not run; remove $cache and run again" >&2; exit 1; }
"$cache/etcd" --version >/dev/null 2>&1 \
  || { echo "control-plane: $cache/etcd does not run; remove $cache and run again" >&2; exit 1; }
echo "$cache"
