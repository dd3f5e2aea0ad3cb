"""Test support shared by tests/ and bench/: installed editable by tools/setup_venv.sh (`make setup`).

- `fakes`: fake vLLM replicas (real HTTP, vLLM 0.31's bodies) with fault injection, for the proxy's tests and
  the proxy benchmarks;
- `fleet`: the process tiers' harness (real replicas, proxy and trainer as fixtures), the device its parameter:
  tests/integration on CPU, tests/gpu on the host's GPUs;
- `stack_plan`, `stack_driver`: what the Compose stack test (tests/stack) runs and how it drives the stack,
  also proven without an engine by tests/compose;
- `compose_helpers`: the static compose/Dockerfile checks' parsers (tests/compose, tests/kubernetes);
- `pids`: whether a process still runs (a zombie does not);
- `traffic`: light completion traffic in a thread (the stack test's evaluation traffic, bench/replica_cpu_bench.py);
- `trainers`: waiting for a real `lorafleet-train` the integration tests started;
- `waiting`: `until`, polling for a condition the system reaches by itself.
"""

from __future__ import annotations

from pathlib import Path

# The repository this package is checked out in (it is installed editable, never copied).
REPO = Path(__file__).resolve().parents[3]
