"""Waiting for a real `lorafleet-train` (a `lorafleet_ops.processes.Service`) the integration tests started."""

from __future__ import annotations

from lorafleet_ops.processes import Service


def finish(trainer: Service, timeout_s: float) -> tuple[int, str]:
    """Wait up to `timeout_s` for the trainer to exit; stop it either way (a time-out raises after the stop).

    Returns its exit code and its whole log.
    """
    assert trainer.process is not None, f"{trainer.name} was never started"
    try:
        code = trainer.process.wait(timeout=timeout_s)
    finally:
        trainer.stop()
    return code, trainer.log_path.read_text()
