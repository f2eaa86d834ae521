#!/usr/bin/env bash
# Start and stop a Kubernetes control plane (etcd and kube-apiserver, no kubelet, no controller
# manager, no scheduler) on loopback, for the tests and for trying the CRD by hand.
#
# usage: scripts/control-plane.sh up DIR     start both; write DIR/kubeconfig and print its path
#        scripts/control-plane.sh down DIR   stop both (DIR is kept: its logs stay readable)
#        scripts/control-plane.sh stop kube-apiserver|etcd DIR    stop one (same etcd data)
#        scripts/control-plane.sh start kube-apiserver|etcd DIR   start it again on its old port
#
# The binaries come from scripts/build-control-plane.sh (`make control-plane`): the folder named by
# BATCHPILOT_CONTROL_PLANE, or the per-machine cache that script prints with --path.
#
# What `up` does, in DIR:
#  1. picks free ports on 127.0.0.1 (etcd's client and peer ports, the API server's secure port);
#     nothing listens beyond loopback;
#  2. makes a CA, a serving certificate for 127.0.0.1 and localhost, an admin client certificate
#     (CN admin, O system:masters) and a service-account signing key pair (openssl);
#  3. starts etcd (data in DIR/etcd, no fsync: test data), waits for its /health;
#  4. starts kube-apiserver with --authorization-mode=RBAC, client-certificate authentication,
#     service-account token signing (issuer https://127.0.0.1:PORT; TokenRequest works), and
#     waits for /readyz;
#  5. writes DIR/kubeconfig (the admin, certificates inline) and prints its path.
# Logs go to DIR/etcd.log and DIR/kube-apiserver.log, process ids to DIR/*.pid.
#
# Without a controller manager nothing creates a namespace's `default` ServiceAccount, so the
# ServiceAccount admission plugin (which refuses a pod whose ServiceAccount does not exist) is off,
# as in controller-runtime's envtest; nothing deletes a namespace's contents either, so a deleted
# namespace stays Terminating. The endpoint reconciler is off (--endpoint-reconciler-type none): it
# refuses a loopback address, and nothing here reaches the API server through the kubernetes
# Service.
set -euo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
ready_timeout_s=${CONTROL_PLANE_READY_TIMEOUT_S:-180}

usage() {
  echo "usage: scripts/control-plane.sh up DIR | down DIR | stop|start kube-apiserver|etcd DIR" >&2
  exit 2
}

binaries() {
  if [ -n "${BATCHPILOT_CONTROL_PLANE:-}" ]; then
    bin=$BATCHPILOT_CONTROL_PLANE
  else
    bin=$("$here/scripts/build-control-plane.sh" --path) || exit 1
  fi
  local name
  for name in etcd kube-apiserver; do
    if [ ! -x "$bin/$name" ]; then
      echo "control-plane: no $name in $bin; run 'make control-plane' (once per machine)" >&2
      exit 1
    fi
  done
}

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

certificates() {
  local certs=$dir/certs
  mkdir -p "$certs"
  (
    cd "$certs"
    openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.crt -days 30 \
      -subj "/CN=batchpilot-test-ca" 2>/dev/null
    openssl req -newkey rsa:2048 -nodes -keyout apiserver.key -out apiserver.csr \
      -subj "/CN=kube-apiserver" 2>/dev/null
    printf 'subjectAltName=IP:127.0.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default.svc\nextendedKeyUsage=serverAuth\n' \
      >apiserver.ext
    openssl x509 -req -in apiserver.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 30 \
      -extfile apiserver.ext -out apiserver.crt 2>/dev/null
    openssl req -newkey rsa:2048 -nodes -keyout admin.key -out admin.csr \
      -subj "/O=system:masters/CN=admin" 2>/dev/null
    printf 'extendedKeyUsage=clientAuth\n' >admin.ext
    openssl x509 -req -in admin.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 30 \
      -extfile admin.ext -out admin.crt 2>/dev/null
    openssl genpkey -algorithm RSA -pkeyopt rsa_keygen_bits:2048 -out sa.key 2>/dev/null
    openssl pkey -in sa.key -pubout -out sa.pub 2>/dev/null
    chmod 600 ./*.key
  )
}

kubeconfig() {
  local b64="base64 -w0"
  cat >"$dir/kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: batchpilot-test
  cluster:
    server: https://127.0.0.1:$apiserver_port
    certificate-authority-data: $($b64 <"$dir/certs/ca.crt")
users:
- name: admin
  user:
    client-certificate-data: $($b64 <"$dir/certs/admin.crt")
    client-key-data: $($b64 <"$dir/certs/admin.key")
contexts:
- name: batchpilot-test
  context:
    cluster: batchpilot-test
    user: admin
current-context: batchpilot-test
EOF
  chmod 600 "$dir/kubeconfig"
}

wait_for() { # name, url, curl arguments...
  local name=$1 url=$2 start
  shift 2
  start=$(date +%s)
  until curl --silent --fail --max-time 5 "$@" "$url" >/dev/null 2>&1; do
    if ! kill -0 "$(cat "$dir/$name.pid")" 2>/dev/null; then
      echo "control-plane: $name exited; the end of $dir/$name.log:" >&2
      tail -n 30 "$dir/$name.log" >&2
      exit 1
    fi
    if [ $(( $(date +%s) - start )) -ge "$ready_timeout_s" ]; then
      echo "control-plane: $name not ready at $url after $ready_timeout_s s; the end of $dir/$name.log:" >&2
      tail -n 30 "$dir/$name.log" >&2
      exit 1
    fi
    sleep 0.5
  done
}

start_etcd() {
  # setsid: the process outlives this script and gets no signal meant for the caller's terminal.
  setsid "$bin/etcd" \
    --name default \
    --data-dir "$dir/etcd" \
    --listen-client-urls "http://127.0.0.1:$etcd_port" \
    --advertise-client-urls "http://127.0.0.1:$etcd_port" \
    --listen-peer-urls "http://127.0.0.1:$etcd_peer_port" \
    --initial-advertise-peer-urls "http://127.0.0.1:$etcd_peer_port" \
    --initial-cluster "default=http://127.0.0.1:$etcd_peer_port" \
    --unsafe-no-fsync \
    --log-level warn \
    >>"$dir/etcd.log" 2>&1 </dev/null &
  echo $! >"$dir/etcd.pid"
  wait_for etcd "http://127.0.0.1:$etcd_port/health"
}

start_apiserver() {
  local certs=$dir/certs
  setsid "$bin/kube-apiserver" \
    --etcd-servers "http://127.0.0.1:$etcd_port" \
    --bind-address 127.0.0.1 \
    --advertise-address 127.0.0.1 \
    --endpoint-reconciler-type none \
    --secure-port "$apiserver_port" \
    --cert-dir "$certs" \
    --tls-cert-file "$certs/apiserver.crt" \
    --tls-private-key-file "$certs/apiserver.key" \
    --client-ca-file "$certs/ca.crt" \
    --authorization-mode RBAC \
    --service-account-issuer "https://127.0.0.1:$apiserver_port" \
    --service-account-key-file "$certs/sa.pub" \
    --service-account-signing-key-file "$certs/sa.key" \
    --service-cluster-ip-range 10.0.0.0/24 \
    --disable-admission-plugins ServiceAccount \
    --allow-privileged=true \
    --profiling=false \
    >>"$dir/kube-apiserver.log" 2>&1 </dev/null &
  echo $! >"$dir/kube-apiserver.pid"
  wait_for kube-apiserver "https://127.0.0.1:$apiserver_port/readyz" \
    --cacert "$certs/ca.crt" --cert "$certs/admin.crt" --key "$certs/admin.key"
}

stop_one() { # name
  local name=$1 pidfile=$dir/$1.pid pid i
  [ -f "$pidfile" ] || return 0
  pid=$(cat "$pidfile")
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid" 2>/dev/null || true
    for i in $(seq 1 100); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.1
    done
    kill -KILL "$pid" 2>/dev/null || true
  fi
  rm -f "$pidfile"
}

load_ports() {
  if [ ! -f "$dir/ports.env" ]; then
    echo "control-plane: $dir has no control plane (no ports.env); run 'up $dir' first" >&2
    exit 1
  fi
  # shellcheck source=/dev/null
  . "$dir/ports.env"
}

command=${1:-}
case "$command" in
  up)
    [ $# -eq 2 ] || usage
    mkdir -p "$2"
    dir=$(cd "$2" && pwd)
    binaries
    for tool in openssl curl python3 base64 setsid; do
      command -v "$tool" >/dev/null 2>&1 \
        || { echo "control-plane: '$tool' is not on PATH; the script needs it" >&2; exit 1; }
    done
    start=$(date +%s.%N)
    etcd_port=$(free_port)
    etcd_peer_port=$(free_port)
    apiserver_port=$(free_port)
    printf 'etcd_port=%s\netcd_peer_port=%s\napiserver_port=%s\n' \
      "$etcd_port" "$etcd_peer_port" "$apiserver_port" >"$dir/ports.env"
    certificates
    # A failure after this point stops what started.
    trap 'stop_one kube-apiserver; stop_one etcd' EXIT
    start_etcd
    start_apiserver
    trap - EXIT
    kubeconfig
    echo "control-plane: kube-apiserver https://127.0.0.1:$apiserver_port and etcd" \
      "http://127.0.0.1:$etcd_port ready in $(python3 -c "print(round($(date +%s.%N) - $start, 1))") s" >&2
    echo "$dir/kubeconfig"
    ;;
  down)
    [ $# -eq 2 ] || usage
    dir=$(cd "$2" && pwd)
    stop_one kube-apiserver
    stop_one etcd
    ;;
  stop | start)
    [ $# -eq 3 ] || usage
    dir=$(cd "$3" && pwd)
    load_ports
    case "$2" in
      kube-apiserver | etcd) ;;
      *) usage ;;
    esac
    if [ "$command" = stop ]; then
      stop_one "$2"
    else
      binaries
      if [ "$2" = etcd ]; then start_etcd; else start_apiserver; fi
    fi
    ;;
  *) usage ;;
esac
