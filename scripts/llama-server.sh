#!/usr/bin/env bash
# Build llama.cpp's llama-server once per machine into a cache outside the clone, and print its path.
#
# The source is the llama.cpp that the llama-cpp-python sdist vendors (MIT), downloaded from PyPI
# with pip at a pinned version and checked against a pinned SHA-256. Only the llama-server target
# is built, for this machine's CPU (GGML_NATIVE), statically linked (one file to cache), without
# OpenSSL, without the web UI (neither built with npm nor downloaded at build time: the server then
# answers / with a short notice), without any GPU backend. The build runs in a temporary folder and
# is renamed into place when complete, under a lock, so that two builds at once neither build it
# twice nor see half of it (as scripts/torch-cache.sh does for torch).
#
# usage: scripts/llama-server.sh [--path]
#   (no argument)  build when the cache lacks it, then print the binary's path as the last line
#   --path         print the binary's path when it is built; exit 1 with a notice when it is not
# environment: PYTHON (a python with pip; default python3), BATCHPILOT_CACHE_DIR (default
#   ~/.cache/batchpilot), LLAMA_SERVER_JOBS (default: the number of cores)
set -euo pipefail

# The pin: llama-cpp-python 0.3.36 vendors llama.cpp's tools/server with `--metrics` (llamacpp:*),
# `/props` (total_slots) and the OpenAI-compatible routes the tests use.
version=0.3.36
sdist_sha256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
# The recipe's revision: bump it when the build flags change, so that a machine's cache of an older
# recipe is rebuilt instead of reused. r2: no AMX tiles (see the flags below).
recipe=r2

python=${PYTHON:-python3}
cache_root=${BATCHPILOT_CACHE_DIR:-$HOME/.cache/batchpilot}/llama-server
cache=$cache_root/$version-$recipe
binary=$cache/bin/llama-server

if [ "${1:-}" = "--path" ]; then
  if [ -x "$binary" ] && [ -f "$cache/.complete" ]; then
    echo "$binary"
    exit 0
  fi
  echo "llama-server: not built at $binary; run 'make llama-server' (once per machine)" >&2
  exit 1
fi
if [ $# -gt 0 ]; then
  echo "usage: scripts/llama-server.sh [--path]" >&2
  exit 2
fi

mkdir -p "$cache_root"
exec 9>"$cache.lock"
flock 9
if [ ! -f "$cache/.complete" ]; then
  start=$(date +%s)
  jobs=${LLAMA_SERVER_JOBS:-$(nproc)}
  work=$(mktemp -d "${TMPDIR:-/tmp}/llama-server-build.XXXXXX")
  trap 'rm -rf "$work"' EXIT
  echo "llama-server: building llama.cpp from llama-cpp-python==$version into $cache (once per machine; -j $jobs)"

  echo "llama-server: [1/4] downloading the sdist from PyPI"
  # pip prepares the sdist's metadata in an isolated environment (scikit-build-core, from PyPI);
  # that does not compile anything.
  "$python" -m pip download --quiet --no-deps --no-binary :all: --dest "$work" "llama-cpp-python==$version"
  sdist=$work/llama_cpp_python-$version.tar.gz
  echo "$sdist_sha256  $sdist" | sha256sum --check --quiet \
    || { echo "llama-server: $sdist does not have the pinned SHA-256" >&2; exit 1; }
  tar -xzf "$sdist" -C "$work"
  src=$work/llama_cpp_python-$version/vendor/llama.cpp
  echo "llama-server: [2/4] extracted llama.cpp after $(( $(date +%s) - start )) s"

  generator=()
  if command -v ninja >/dev/null 2>&1; then
    generator=(-G Ninja)
  fi
  echo "llama-server: [3/4] configuring (CPU only, Release, static)"
  # GGML_NATIVE compiles for this CPU, AMX tiles included where it has them (Sapphire Rapids and later);
  # ggml's AMX matmul then crashes with SIGSEGV on the first forward pass when the kernel does not grant
  # the process the tile state (seen on a 2-core VM whose CPU lists amx_tile and amx_int8). Explicit
  # -mno-amx-* flags win over what -march=native implies in GCC, so the AVX-512 kernels are kept.
  no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
  cmake -S "$src" -B "$work/build" "${generator[@]}" \
    -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_C_FLAGS="$no_amx" -DCMAKE_CXX_FLAGS="$no_amx" \
    -DBUILD_SHARED_LIBS=OFF \
    -DGGML_NATIVE=ON \
    -DGGML_CUDA=OFF -DGGML_VULKAN=OFF -DGGML_METAL=OFF -DGGML_HIP=OFF -DGGML_SYCL=OFF \
    -DGGML_OPENCL=OFF -DGGML_RPC=OFF -DGGML_BLAS=OFF \
    -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
    >"$work/configure.log" 2>&1 \
    || { cat "$work/configure.log" >&2; exit 1; }
  echo "llama-server: [4/4] compiling the llama-server target after $(( $(date +%s) - start )) s"
  # Progress lines only ([n/N] ...); the compiler's warnings go to the log, shown when the build fails.
  set +e
  cmake --build "$work/build" --target llama-server --parallel "$jobs" 2>&1 \
    | tee "$work/build.log" | { grep --line-buffered -E '^\[[0-9]+/[0-9]+\]' || true; }
  status=${PIPESTATUS[0]}
  set -e
  if [ "$status" -ne 0 ]; then
    echo "llama-server: the build failed ($status); the end of its log:" >&2
    tail -n 60 "$work/build.log" >&2
    exit 1
  fi

  rm -rf "$cache.partial"
  mkdir -p "$cache.partial/bin"
  cp "$work/build/bin/llama-server" "$cache.partial/bin/llama-server"
  cp "$src/LICENSE" "$cache.partial/LICENSE"
  elapsed=$(( $(date +%s) - start ))
  printf 'llama-cpp-python %s\nsdist sha256 %s\nrecipe %s (%s)\nbuild seconds %s (-j %s)\n' \
    "$version" "$sdist_sha256" "$recipe" "$no_amx" "$elapsed" "$jobs" >"$cache.partial/BUILD-INFO"
  touch "$cache.partial/.complete"
  rm -rf "$cache"
  mv "$cache.partial" "$cache"
  echo "llama-server: built in $elapsed s ($(du -h "$binary" | cut -f1))"
else
  echo "llama-server: reusing $cache ($(grep 'build seconds' "$cache/BUILD-INFO" || true))"
fi
flock -u 9
"$binary" --version >/dev/null 2>&1 \
  || { echo "llama-server: $binary does not run; remove $cache and run again" >&2; exit 1; }
echo "$binary"
