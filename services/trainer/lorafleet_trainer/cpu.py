"""Run TRL 1.16's AsyncGRPOTrainer without CUDA, for real: the CPU demo and the integration tests.

TRL asks CUDA for the device's peak FLOPs in the trainer's `__init__`; a CPU has no entry.
`install_cpu_support()` turns the MFU metrics off and caps torch's threads; the attention kernel is
chosen by `attention.choose_backend` (on CPU, always the pure-PyTorch one).
"""

from __future__ import annotations

import logging

import torch

from lorafleet_trainer import trl_seam

log = logging.getLogger(__name__)


def _no_peak_flops(_accelerator: object, _dtype: str) -> None:
    """CPUs have no peak-FLOPs entry: MFU metrics are off, throughput and timings still logged."""
    return None


def install_cpu_support(threads: int = 0) -> None:
    """Make TRL's AsyncGRPOTrainer train on CPU: no CUDA peak-FLOPs query, a bounded thread count.

    `threads` > 0 caps torch's threads: next to vLLM replicas on the same cores, OpenMP spinning
    on busy cores made a step ~5x slower than one thread.
    """
    trl_seam.set_peak_flops_query(_no_peak_flops)
    if threads:
        torch.set_num_threads(threads)
    log.info("CPU mode: MFU metrics off", extra={"fields": {"torch_threads": torch.get_num_threads()}})
