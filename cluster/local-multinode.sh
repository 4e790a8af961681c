#!/usr/bin/env bash
# local-multinode.sh -- run a real N-node Ray cluster on ONE Linux host, each node
# with its own loopback IP (127.0.0.2, 127.0.0.3, ...), so Ray Train assigns
# distinct node ranks (node_rank 0..N-1) and gloo collectives cross "nodes".
#
#   local-multinode.sh up [N]      start N nodes (default 2), print RAY_ADDRESS
#   local-multinode.sh add         one more node joins the running cluster (a node added later)
#   local-multinode.sh status      show nodes / process groups
#   local-multinode.sh down        stop every process this script started (by session id)
#
# raytrainer's version of ../shared/cluster-recipe: adds token auth (RAY_MN_AUTH_MODE=token with
# RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH in the environment; the token is never written to the state dir),
# the dashboard / Jobs API (RAY_MN_DASHBOARD=true, URL in $RAY_MN_STATE/dashboard), the repo's .venv by
# default, and worker settings raytrainer wants on every node (no duplicated print lines, no log dedup).
#
# After `up`:  . "$RAY_MN_STATE/env.sh"   (exports RAY_ADDRESS + required RAY_* vars)
#              python -c 'import ray; ray.init(address="auto")'
#
# Tunables (env):
#   RAY_MN_STATE=/tmp/ray-mn          state dir: pids, logs, per-node ray temp dirs
#   RAY_MN_VENV=<repo>/.venv          venv to activate ("" = use the python on PATH)
#   RAY_MN_IP_BASE=127.0.0  RAY_MN_IP_START=2   node i gets $BASE.$((START+i))
#                                     (never 127.0.0.1/localhost: Ray rewrites it to the
#                                      primary interface IP, which is unreachable here)
#   RAY_MN_PORT=0                     GCS port (0 = pick a free one)
#   RAY_MN_CPUS=1                     CPUs per node (Train worker = 1 CPU each)
#   RAY_MN_OBJ_STORE=536870912        object store bytes per node (default 512 MiB)
#   RAY_MN_DASHBOARD=false            true needs ray[default] (aiohttp, ...); without it
#                                     Train's PlacementGroupCleaner logs a harmless "State
#                                     API may be temporarily unavailable" every few seconds
#   RAY_MN_LIFETIME=3600              hard cap (s): `timeout` kills a node after this
#   RAY_MN_DRAIN_TIMEOUT_S=0          on SIGTERM a node drains (Ray's preemption notice) for up to
#                                     this long before it stops; 0: it stops at once
#   RAY_MN_UP_TIMEOUT=120             max seconds to wait for all nodes to register
#   RAY_MN_AUTH_MODE=disabled         or "token" (uses ~/.ray/auth_token / RAY_AUTH_TOKEN*)
#   RAY_MN_WORKER_PORT_BASE=23000     node i uses worker ports [base+1000i, base+1000i+999]: outside
#                                     Ray's default 10002-19999 and the ephemeral ports (32768+) that
#                                     free ports come from (refused if it reaches in); shift it for a
#                                     2nd cluster on the host
set -euo pipefail

STATE=${RAY_MN_STATE:-/tmp/ray-mn}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
VENV=${RAY_MN_VENV-$HERE/../.venv}
IP_BASE=${RAY_MN_IP_BASE:-127.0.0}
IP_START=${RAY_MN_IP_START:-2}
CPUS=${RAY_MN_CPUS:-1}
OBJ=${RAY_MN_OBJ_STORE:-536870912}
DASH=${RAY_MN_DASHBOARD:-false}
LIFETIME=${RAY_MN_LIFETIME:-3600}
UP_TIMEOUT=${RAY_MN_UP_TIMEOUT:-120}

if [[ -n "$VENV" && -f "$VENV/bin/activate" ]]; then . "$VENV/bin/activate"; fi
PY=$(command -v python || command -v python3)

# Required for every Ray process of this cluster (nodes AND drivers): written to env.sh.
# RAY_AUTH_MODE: if unset, `ray start --head` silently turns token auth ON when
# ~/.ray/auth_token exists, while `ray start --address` / drivers stay 'disabled' and
# are rejected (InvalidAuthToken). Pin it for every process: disabled (default) or token.
export RAY_AUTH_MODE=${RAY_MN_AUTH_MODE:-disabled}
# SIGTERM to a node: 0 tears it down in ~2s; N > 0 drains it first for up to N s, as a Kubernetes pod's
# eviction does (Ray marks it draining for preemption, so Ray Train's workers get notice), then kills it
export RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=${RAY_MN_DRAIN_TIMEOUT_S:-0}
export RAY_USAGE_STATS_ENABLED=0
export RAY_TRAIN_ENABLE_PRINT_PATCH=0  # a worker's print() appears once on the driver
export RAY_DEDUP_LOGS=0
if [[ "$RAY_AUTH_MODE" == token && -z "${RAY_AUTH_TOKEN:-}" && -z "${RAY_AUTH_TOKEN_PATH:-}" ]]; then
  echo "RAY_MN_AUTH_MODE=token needs RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH in the environment" >&2; exit 2
fi

now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN{printf "%.1f", b-a}'; }

free_port() {  # free TCP port on the given IP
  "$PY" -c 'import socket,sys; s=socket.socket(); s.bind((sys.argv[1],0)); print(s.getsockname()[1])' "$1"
}

wait_log() {  # wait_log FILE PID SECONDS : until `ray start --block` reports ready
  local f=$1 pid=$2 deadline=$(( $(date +%s) + $3 ))
  until grep -q "block forever" "$f" 2>/dev/null; do
    if ! kill -0 "$pid" 2>/dev/null; then echo "node process $pid died; log:" >&2; tail -30 "$f" >&2; return 1; fi
    if (( $(date +%s) > deadline )); then echo "timeout waiting for $f" >&2; tail -30 "$f" >&2; return 1; fi
    sleep 0.25
  done
}

check_ports() {  # check_ports IDX : node IDX's worker ports stay below the ephemeral range
  local pb=${RAY_MN_WORKER_PORT_BASE:-23000} eph
  eph=$(cut -f1 /proc/sys/net/ipv4/ip_local_port_range 2>/dev/null || echo 32768)
  if (( pb + $1 * 1000 + 999 >= eph )); then  # free ports (the agent's, a driver's) come from there: clash
    echo "node $1's worker ports $((pb + $1 * 1000))-$((pb + $1 * 1000 + 999)) reach into the ephemeral" \
         "port range (from $eph): set RAY_MN_WORKER_PORT_BASE to at most $((eph - 1000 * ($1 + 1)))" >&2
    exit 2
  fi
}

start_node() {  # start_node IDX ARGS... ; runs `ray start --block` in its own session
  local i=$1; shift
  local ip="$IP_BASE.$((IP_START + i))"
  local tmp="$STATE/n$i"            # per-node temp dir: own session dir + log monitor,
  mkdir -p "$tmp"                   # so driver logs are not duplicated / mislabelled
  rm -f "$STATE/node$i.log"         # (wait_log must not see a previous run's log)
  local pb=${RAY_MN_WORKER_PORT_BASE:-23000}  # disjoint worker-port range per node
  local wmin=$((pb + i * 1000)) wmax=$((pb + i * 1000 + 999))
  setsid timeout -s TERM -k 10 "$LIFETIME" ray start --block \
      --node-ip-address="$ip" --num-cpus="$CPUS" --num-gpus=0 \
      --object-store-memory="$OBJ" --temp-dir="$tmp" \
      --min-worker-port="$wmin" --max-worker-port="$wmax" \
      --dashboard-agent-listen-port="$(free_port "$ip")" \
      --disable-usage-stats "$@" >"$STATE/node$i.log" 2>&1 < /dev/null &
  echo $! >"$STATE/node$i.pid"      # setsid execs timeout => this PID is also the PGID
}

alive_nodes() {
  "$PY" - "$1" <<'EOF'
import sys
from ray._raylet import GcsClient
from ray.core.generated.gcs_pb2 import GcsNodeInfo
infos = GcsClient(address=sys.argv[1]).get_all_node_info(
    timeout=10, state_filter=GcsNodeInfo.GcsNodeState.ALIVE)
print(" ".join(sorted(i.node_manager_address for i in infos.values())))
EOF
}

cmd_up() {
  local n=${1:-2}
  (( n >= 1 )) || { echo "N must be >= 1" >&2; exit 2; }
  if compgen -G "$STATE/node*.pid" >/dev/null; then
    echo "cluster state exists in $STATE; run '$0 down' first" >&2; exit 1
  fi
  check_ports $((n - 1))
  mkdir -p "$STATE"
  rm -rf "$STATE"/n[0-9]* "$STATE"/node*.log   # previous run's per-node temp dirs + logs
  local t0; t0=$(now)
  local head_ip="$IP_BASE.$IP_START"
  local port=${RAY_MN_PORT:-0}; [[ "$port" == 0 ]] && port=$(free_port "$head_ip")
  local addr="$head_ip:$port"
  # a (minimal) dashboard process runs even with --include-dashboard=false and would
  # take the fixed port 8265 -> give it a free one so concurrent clusters don't clash
  local dash_port; dash_port=$(free_port 127.0.0.1)
  local dash_args=(--include-dashboard="$DASH" --dashboard-host=127.0.0.1 --dashboard-port="$dash_port")
  # (no --ray-client-server-port: passing it errors unless ray[client] is installed)
  start_node 0 --head --port="$port" "${dash_args[@]}"
  wait_log "$STATE/node0.log" "$(cat "$STATE/node0.pid")" "$UP_TIMEOUT" || { cmd_down; exit 1; }
  echo "head $addr up in $(since "$t0")s"
  for ((i = 1; i < n; i++)); do start_node "$i" --address="$addr"; done
  for ((i = 1; i < n; i++)); do
    wait_log "$STATE/node$i.log" "$(cat "$STATE/node$i.pid")" "$UP_TIMEOUT" || { cmd_down; exit 1; }
  done
  local deadline=$(( $(date +%s) + UP_TIMEOUT )) ips=""
  while :; do
    ips=$(alive_nodes "$addr" 2>/dev/null || true)
    [[ $(wc -w <<<"$ips") -ge $n ]] && break
    (( $(date +%s) > deadline )) && { echo "only [$ips] registered" >&2; cmd_down; exit 1; }
    sleep 0.5
  done
  cat >"$STATE/env.sh" <<EOF
export RAY_ADDRESS=$addr
export RAY_AUTH_MODE=$RAY_AUTH_MODE
export RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=$RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S
export RAY_USAGE_STATS_ENABLED=0
export RAY_TRAIN_ENABLE_PRINT_PATCH=0
EOF
  echo "$addr" >"$STATE/address"
  if [[ "$DASH" == true ]]; then echo "http://127.0.0.1:$dash_port" >"$STATE/dashboard"; fi
  echo "cluster of $n nodes [$ips] up in $(since "$t0")s; RAY_ADDRESS=$addr  (. $STATE/env.sh)"
  if [[ "$DASH" == true ]]; then echo "dashboard / Jobs API: $(cat "$STATE/dashboard")"; fi
}

cmd_add() {  # one more node joins the running cluster (a node an autoscaler or a spot market adds later)
  [[ -f "$STATE/address" ]] || { echo "no cluster in $STATE; run '$0 up' first" >&2; exit 1; }
  local i=0; while [[ -f "$STATE/node$i.pid" ]]; do i=$((i + 1)); done
  check_ports "$i"
  start_node "$i" --address="$(cat "$STATE/address")"
  wait_log "$STATE/node$i.log" "$(cat "$STATE/node$i.pid")" "$UP_TIMEOUT" || exit 1
  echo "node $i ($IP_BASE.$((IP_START + i))) joined"
}

node_pids() {  # every live process of our nodes. Each node runs in its own session
  # (setsid => SID == PGID == pid in node*.pid). Ray worker/actor processes call
  # setpgid() (own PGID) but keep the SID, so select by session, not process group.
  local f
  for f in "$STATE"/node*.pid; do [[ -f "$f" ]] && pgrep -s "$(cat "$f")" || true; done
}

cmd_down() {
  local t0 pids
  t0=$(now)
  if ! compgen -G "$STATE/node*.pid" >/dev/null; then echo "nothing to stop in $STATE"; return 0; fi
  pids=$(node_pids)
  [[ -n "$pids" ]] && kill -TERM $pids 2>/dev/null || true
  local deadline=$(( $(date +%s) + 15 ))
  while pids=$(node_pids) && [[ -n "$pids" ]]; do
    if (( $(date +%s) > deadline )); then kill -KILL $pids 2>/dev/null || true; sleep 0.5; break; fi
    sleep 0.25
  done
  pids=$(node_pids)
  rm -f "$STATE"/node*.pid "$STATE/env.sh" "$STATE/address" "$STATE/dashboard"
  echo "cluster down in $(since "$t0")s${pids:+ (still alive: $pids)}"
}

cmd_status() {
  local f g
  [[ -f "$STATE/address" ]] && echo "address: $(cat "$STATE/address")  alive: $(alive_nodes "$(cat "$STATE/address")")"
  for f in "$STATE"/node*.pid; do
    [[ -f "$f" ]] || continue; g=$(cat "$f")
    echo "== $(basename "$f" .pid) sid=$g"; ps -o pid=,pgid=,stat=,args= -s "$g" | cut -c1-110 || true
  done
}

case "${1:-}" in
  up) cmd_up "${2:-2}" ;;
  add) cmd_add ;;
  down) cmd_down ;;
  status) cmd_status ;;
  *) sed -n '2,12p' "$0"; exit 2 ;;
esac
