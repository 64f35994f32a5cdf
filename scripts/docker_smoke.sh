#!/usr/bin/env bash
# End-to-end check of the container deployment; prints ONE JSON line on stdout:
#   {"image_mb": ..., "build_s": ..., "peers_joined": ..., "rounds": ..., "replicas_identical": ...,
#    "scraped_targets": ..., "resumed": ..., ...}
#
# 1. builds the CPU variant of docker/Dockerfile from a local Debian base (debootstrap minbase,
#    `docker import`; reused when present) with the host's CPU torch wheel and CA bundle handed
#    in through docker/build-extras/, and a Prometheus image from Debian's package;
# 2. `docker-compose up` of deploy/docker-compose.yml: bootstrap + peer-1 + peer-2 (training)
#    + Prometheus; waits for the healthchecks, the rounds, identical replicas and every node
#    scraped; checks the containers run as the non-root user;
# 3. a node outside the compose network (`docker run -p HOST_PORT:4001 ... --announce`) joins,
#    and the compose peers reach it directly at the announced, port-mapped address;
# 4. `down`, then `up` with more rounds: the peers resume from their volumes' checkpoints.
#
# Uses the running Docker daemon; without one (and as root) it starts dockerd with its bridge
# and address pools in the benchmarking range 198.18.0.0/15 and stops it at the end. Everything
# the script creates (containers, networks, volumes) is removed at the end; images are kept.
# Progress goes to stderr. Environment: DOCKER, COMPOSE, LATTICA_SMOKE_KEEP=1 (keep the stack).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
DOCKER=${DOCKER:-docker}
COMPOSE=${COMPOSE:-docker-compose}
PROJECT=lattica-smoke
IMAGE=lattica:cpu
BASE=lattica-base:bookworm
PROM_IMAGE=lattica-prometheus:local
ROUNDS_FIRST=2
ROUNDS_AFTER=4
OUTSIDE=lattica-smoke-outside
WORK=$(mktemp -d)
DOCKERD_PID=""
FORWARD_POLICY=""
PY=python3
[ -x "$ROOT/.venv/bin/python" ] && PY="$ROOT/.venv/bin/python"

log() { echo "docker_smoke: $*" >&2; }
die() { log "FAILED: $*"; exit 1; }

compose() {
    LATTICA_IMAGE=$IMAGE PROMETHEUS_IMAGE=$PROM_IMAGE LATTICA_BOOTSTRAP_PORT=$BOOT_PORT \
    PROMETHEUS_PORT=$PROM_PORT LATTICA_TRAIN_INNER_STEPS=5 LATTICA_TRAIN_BATCH_SIZE=4 \
    LATTICA_TRAIN_SEQ_LEN=32 LATTICA_TRAIN_ROUNDS=$ROUNDS LATTICA_LOG_LEVEL=info \
    $COMPOSE -p "$PROJECT" -f deploy/docker-compose.yml "$@"
}

remove_dockerd_traces() {  # what a stopped dockerd leaves: its bridge and iptables chains
    ip link delete docker0 2>/dev/null
    iptables -t nat -D POSTROUTING -s 198.18.200.0/24 ! -o docker0 -j MASQUERADE 2>/dev/null
    iptables -t nat -D PREROUTING -m addrtype --dst-type LOCAL -j DOCKER 2>/dev/null
    iptables -t nat -D OUTPUT ! -d 127.0.0.0/8 -m addrtype --dst-type LOCAL -j DOCKER 2>/dev/null
    iptables -t nat -F DOCKER 2>/dev/null && iptables -t nat -X DOCKER 2>/dev/null
    for rule in "-j DOCKER-USER" "-j DOCKER-ISOLATION-STAGE-1" \
                "-o docker0 -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT" "-o docker0 -j DOCKER" \
                "-i docker0 ! -o docker0 -j ACCEPT" "-i docker0 -o docker0 -j ACCEPT"; do
        # shellcheck disable=SC2086
        iptables -D FORWARD $rule 2>/dev/null
    done
    for chain in DOCKER DOCKER-ISOLATION-STAGE-1 DOCKER-ISOLATION-STAGE-2 DOCKER-USER; do
        iptables -F "$chain" 2>/dev/null
    done
    for chain in DOCKER DOCKER-ISOLATION-STAGE-1 DOCKER-ISOLATION-STAGE-2 DOCKER-USER; do
        iptables -X "$chain" 2>/dev/null
    done
    [ "$FORWARD_POLICY" = ACCEPT ] && iptables -P FORWARD ACCEPT
}

cleanup() {
    set +e
    if [ "${LATTICA_SMOKE_KEEP:-0}" != 1 ]; then
        $DOCKER rm -f "$OUTSIDE" >/dev/null 2>&1
        $DOCKER volume rm "$OUTSIDE-data" >/dev/null 2>&1
        [ -n "${BOOT_PORT:-}" ] && ROUNDS=0 compose down -v --remove-orphans >/dev/null 2>&1
    fi
    if [ -n "$DOCKERD_PID" ]; then
        kill "$DOCKERD_PID" 2>/dev/null
        for _ in $(seq 1 30); do kill -0 "$DOCKERD_PID" 2>/dev/null || break; sleep 1; done
        remove_dockerd_traces
    fi
    rm -rf "$WORK"
}
trap cleanup EXIT

free_port() { $PY -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# wait_for SECONDS WHAT COMMAND...: poll COMMAND until it succeeds
wait_for() {
    local limit=$1 what=$2; shift 2
    local until=$(( $(date +%s) + limit ))
    until "$@" >/dev/null 2>&1; do
        [ "$(date +%s)" -lt "$until" ] || die "$what (not within ${limit} s)"
        sleep 2
    done
}

cid() { compose ps -q "$1"; }
in_node() { local c; c=$(cid "$1"); shift; $DOCKER exec "$c" lattica "$@"; }
json() { $PY -c "import json,sys; d=json.load(sys.stdin); print($1)"; }

# -- a Docker daemon -----------------------------------------------------------------------------
if ! $DOCKER info >/dev/null 2>&1; then
    command -v dockerd >/dev/null || die "no Docker daemon and no dockerd to start"
    log "starting dockerd (bridge 198.18.200.1/24, pools 198.19.200.0/21)"
    FORWARD_POLICY=$(iptables -S FORWARD 2>/dev/null | awk '$1 == "-P" {print $3}')  # dockerd sets DROP
    dockerd --bip 198.18.200.1/24 --default-address-pool base=198.19.200.0/21,size=24 \
        --storage-driver overlay2 --pidfile "$WORK/dockerd.pid" >"$WORK/dockerd.log" 2>&1 &
    DOCKERD_PID=$!
    wait_for 60 "dockerd starts" $DOCKER info
fi
HOST_IP=$($DOCKER network inspect bridge -f '{{(index .IPAM.Config 0).Gateway}}')

# -- images ---------------------------------------------------------------------------------------
if ! $DOCKER image inspect "$BASE" >/dev/null 2>&1; then
    log "making the base image $BASE (debootstrap --variant=minbase bookworm)"
    nice -n 10 debootstrap --variant=minbase bookworm "$WORK/rootfs" http://deb.debian.org/debian >&2
    rm -f "$WORK"/rootfs/var/cache/apt/archives/*.deb
    tar -C "$WORK/rootfs" -c . | $DOCKER import - "$BASE" >/dev/null
    rm -rf "$WORK/rootfs"
fi
extras=docker/build-extras
cert=${PIP_CERT:-$($PY -m pip config get global.cert 2>/dev/null || true)}
[ -n "$cert" ] && [ -f "$cert" ] && cp "$cert" "$extras/ca.crt"
torch_version=$($PY -c 'import torch; print(torch.__version__)')
case "$torch_version" in
    *+cpu) compgen -G "$extras/torch-$torch_version-*.whl" >/dev/null \
           || $PY -m pip download -q --no-deps "torch==$torch_version" -d "$extras" >&2 ;;
    *) log "the host's torch ($torch_version) is not a CPU build: the image takes torch from the index" ;;
esac
log "building $IMAGE"
start=$(date +%s)
nice -n 10 $DOCKER build -q -f docker/Dockerfile -t "$IMAGE" --build-arg BASE_IMAGE="$BASE" \
    --build-arg PYTHON_PACKAGES="python3 python3-venv" . >&2
build_s=$(( $(date +%s) - start ))
image_mb=$(( $($DOCKER image inspect -f '{{.Size}}' "$IMAGE") / 1000000 ))
nice -n 10 $DOCKER build -q -f deploy/prometheus.Dockerfile -t "$PROM_IMAGE" --build-arg BASE_IMAGE="$BASE" deploy >&2

# the entry point takes both spellings
$DOCKER run --rm "$IMAGE" --help >/dev/null || die "docker run IMAGE --help"
$DOCKER run --rm "$IMAGE" lattica --help >/dev/null || die "docker run IMAGE lattica --help"

# -- the stack ------------------------------------------------------------------------------------
BOOT_PORT=$(free_port); PROM_PORT=$(free_port); OUT_PORT=$(free_port)
ROUNDS=$ROUNDS_FIRST
log "compose up (bootstrap + 2 peers + prometheus), $ROUNDS rounds"
compose up -d --no-build bootstrap peer-1 peer-2 prometheus >&2

healthy() { [ "$($DOCKER inspect -f '{{.State.Health.Status}}' "$(cid "$1")")" = healthy ]; }
for node in bootstrap peer-1 peer-2; do wait_for 240 "$node healthy" healthy "$node"; done

rounds_done() {  # every peer finished $1 rounds
    for node in peer-1 peer-2; do
        [ "$(in_node "$node" status --json | json 'd.get("training", {}).get("rounds_completed", 0)')" -ge "$1" ] || return 1
    done
}
identical() {  # both peers' replicated progress shows the same weights at the same round
    in_node bootstrap state --json | json '
len({(p.get("round"), p.get("weights_hash")) for p in d.get("progress", {}).values()}) == 1
and len(d.get("progress", {})) == 2' | grep -qx True
}
non_root() {
    for node in bootstrap peer-1 peer-2; do
        [ "$($DOCKER exec "$(cid "$node")" id -u)" != 0 ] || return 1
        [ "$($DOCKER exec "$(cid "$node")" stat -c %U /var/lib/lattica/identity.key)" = lattica ] || return 1
    done
}
scraped() {  # Prometheus: every lattica target up
    curl -fsS "http://127.0.0.1:$PROM_PORT/api/v1/targets" | json '
sum(1 for t in d["data"]["activeTargets"] if t["labels"]["job"] == "lattica" and t["health"] == "up")'
}
all_scraped() { [ "$(scraped)" = 3 ]; }

wait_for 600 "$ROUNDS rounds trained" rounds_done "$ROUNDS"
wait_for 60 "replicas identical" identical
wait_for 90 "prometheus scrapes all nodes" all_scraped
scraped_targets=$(scraped)
non_root_ok=false; non_root && non_root_ok=true

# -- a node outside the compose network, behind a port mapping ------------------------------------
boot_id=$(in_node bootstrap id --json | json 'd["peer_id"]')
log "outside node: -p $OUT_PORT:4001 --announce /ip4/$HOST_IP/tcp/$OUT_PORT"
$DOCKER run -d --name "$OUTSIDE" -p "$OUT_PORT:4001" -v "$OUTSIDE-data:/var/lib/lattica" "$IMAGE" \
    join --data-dir /var/lib/lattica --listen /ip4/0.0.0.0/tcp/4001 --metrics-addr off --run-id demo \
    --announce "/ip4/$HOST_IP/tcp/$OUT_PORT" --peer "/ip4/$HOST_IP/tcp/$BOOT_PORT/p2p/$boot_id" >/dev/null
wait_for 120 "outside node up" $DOCKER exec "$OUTSIDE" lattica status
outside_id=$($DOCKER exec "$OUTSIDE" lattica id --json | json 'd["peer_id"]')
direct_to_outside() {  # the compose peers hold a direct connection to the announced address
    for node in peer-1 peer-2; do
        in_node "$node" peers --json | json "any(p['peer_id'] == '$outside_id' and p['connected']
and p.get('path') == 'direct' for p in d)" | grep -qx True || return 1
    done
}
outside_joined=false
wait_for 120 "outside node reached directly" direct_to_outside && outside_joined=true
peers_joined=$(in_node bootstrap peers --json | json 'sum(1 for p in d if p["connected"])')
$DOCKER exec "$OUTSIDE" lattica doctor --json > "$WORK/doctor-outside.json" || true
outside_nat=$(json 'd["nat"]["kind"] if d.get("nat") else None' < "$WORK/doctor-outside.json")
$DOCKER rm -f "$OUTSIDE" >/dev/null

# -- down, up: resume from the volumes --------------------------------------------------------------
ids_before=$(for n in peer-1 peer-2; do in_node "$n" id --json | json 'd["peer_id"]'; done)
log "compose down; up with $ROUNDS_AFTER rounds"
compose down >&2
ROUNDS=$ROUNDS_AFTER
compose up -d --no-build bootstrap peer-1 peer-2 prometheus >&2
for node in bootstrap peer-1 peer-2; do wait_for 240 "$node healthy again" healthy "$node"; done
ids_after=$(for n in peer-1 peer-2; do in_node "$n" id --json | json 'd["peer_id"]'; done)
wait_for 600 "$ROUNDS rounds trained after the restart" rounds_done "$ROUNDS"
wait_for 60 "replicas identical after the restart" identical
resumed=true
[ "$ids_before" = "$ids_after" ] || { log "peer ids changed across the restart"; resumed=false; }
for node in peer-1 peer-2; do
    compose logs --no-color "$node" > "$WORK/$node.log" 2>&1  # whole, then grep: no SIGPIPE under pipefail
    grep -q "resumed at step" "$WORK/$node.log" || { log "$node did not resume from its checkpoint"; resumed=false; }
done
rounds=$(in_node peer-1 status --json | json 'd["training"]["rounds_completed"]')
healthy_ok=true
for node in bootstrap peer-1 peer-2; do healthy "$node" || healthy_ok=false; done
replicas_identical=false; identical && replicas_identical=true

printf '{"image_mb": %s, "build_s": %s, "peers_joined": %s, "rounds": %s, "replicas_identical": %s, "scraped_targets": %s, "resumed": %s, "healthy": %s, "non_root": %s, "outside_peer_joined": %s, "outside_nat": "%s"}\n' \
    "$image_mb" "$build_s" "$peers_joined" "$rounds" "$replicas_identical" "$scraped_targets" "$resumed" \
    "$healthy_ok" "$non_root_ok" "$outside_joined" "$outside_nat"
