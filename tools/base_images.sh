#!/usr/bin/env bash
# Base images for the cpu profile's Dockerfiles where no container registry can be reached (CI, offline hosts).
# For each base image that is absent locally, try a short pull; if that fails, build a STAND-IN of the same name
# from Debian's packages and say so. The stand-in for python:3.11-slim-bookworm is Debian 12's own Python 3.11 with
# pip, venv and Python's headers (the official image ships them; torch inductor, which vLLM's CPU sampler uses,
# compiles against them), not the official image's build of Python: results that depend on it say so.
# Never replaces an image that exists. Needs root (debootstrap) and a Docker engine (DOCKER_HOST).
set -euo pipefail
BASE=python:3.11-slim-bookworm
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}

say() { printf '==> base images: %s\n' "$*" >&2; }

if docker image inspect "$BASE" >/dev/null 2>&1; then
  say "$BASE present"
  exit 0
fi
if timeout 30 docker pull -q "$BASE" >/dev/null 2>&1; then
  say "$BASE pulled"
  exit 0
fi
say "$BASE cannot be pulled here: building a STAND-IN from Debian's packages (Debian's Python 3.11, not the official image's)"
command -v debootstrap >/dev/null 2>&1 || { say "debootstrap is missing (apt-get install debootstrap)"; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
debootstrap --variant=minbase --include=python3,python3-pip,python3-venv,python3-dev,ca-certificates \
  bookworm "$work/rootfs" "$MIRROR" >"$work/debootstrap.log" 2>&1 \
  || { tail -n 20 "$work/debootstrap.log" >&2; exit 1; }
# The host's trust store: the stand-in reaches the package registries the way this host does (a TLS-inspecting
# proxy's CA included, where the host has one).
cp /etc/ssl/certs/ca-certificates.crt "$work/rootfs/etc/ssl/certs/ca-certificates.crt"
ln -sf /usr/bin/python3 "$work/rootfs/usr/local/bin/python"
ln -sf /usr/bin/pip3 "$work/rootfs/usr/local/bin/pip"
rm -rf "$work/rootfs/var/cache/apt/archives/"*.deb "$work/rootfs/var/lib/apt/lists/"*
# The official image's environment: a C.UTF-8 locale; pip may install into the system Python (PEP 668 marker).
tar -C "$work/rootfs" -c . | docker import \
  -c 'ENV LANG=C.UTF-8' -c 'ENV PIP_BREAK_SYSTEM_PACKAGES=1' -c 'CMD ["python3"]' \
  -m "lorafleet stand-in for $BASE (debootstrap bookworm)" - "$BASE" >/dev/null
say "$BASE stand-in built"
