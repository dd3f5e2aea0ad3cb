#!/usr/bin/env bash
# Debian packages the benchmarks and tests run for real: wrk (load generator of `make bench`) and
# prometheus/promtool (the monitoring profile's config and dashboard queries, checked live by the tests), and
# shellcheck (actionlint runs it on the GitHub workflows' run: scripts).
# Installs only what is missing; needs root or sudo for apt-get. Called by `make setup`.
set -euo pipefail
PACKAGES=(wrk prometheus shellcheck)
BINARIES=(wrk prometheus shellcheck)
missing=()
for i in "${!PACKAGES[@]}"; do
  command -v "${BINARIES[$i]}" >/dev/null 2>&1 || missing+=("${PACKAGES[$i]}")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -eq 0 ]; then SUDO=(); elif command -v sudo >/dev/null 2>&1; then SUDO=(sudo); else
  echo "setup_system: missing Debian packages: ${missing[*]}; install them as root (apt-get install ${missing[*]})" >&2
  exit 1
fi
printf '\n==> installing Debian packages: %s\n' "${missing[*]}"
"${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -qq
"${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
