"""What every benchmark result records about its own run, so that a page can say when, where and on what it ran.

Each benchmark puts `run_record(...)` under the key `RECORD_KEY` of the JSON it writes and writes it with
`write_result`, one format for every file; the docs' macros read the same keys back (lorafleet_ops.docsite.macros).
Standard library only: the GPU benchmarks run it on a bare machine.
A value that cannot be found is left out, never guessed: the page then shows "not recorded".
"""

from __future__ import annotations

import importlib.metadata as metadata
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

RECORD_KEY = "meta"
DATE_FORMAT = "%Y-%m-%d %H:%M UTC"
REPO = Path(__file__).resolve().parents[3]
# Distributions whose versions decide a benchmark's figures; those not installed are left out.
DISTRIBUTIONS = ("lorafleet", "lorafleet-ops", "lorafleet-proxy", "lorafleet-replica", "lorafleet-trainer", "vllm",
                 "torch", "transformers", "trl", "peft", "accelerate", "liger-kernel", "fastapi", "uvicorn",
                 "httptools")


def run_record(argv: list[str] | None = None) -> dict[str, Any]:
    """The date, the command, the machine (cores, CPU, GPUs), the versions and the git commit of this run."""
    record: dict[str, Any] = {
        "date": time.strftime(DATE_FORMAT, time.gmtime()),
        "command": " ".join(["python", *(sys.argv if argv is None else argv)]),
        "machine": machine(),
        "versions": versions(),
    }
    commit = git_commit()
    if commit is not None:
        record["commit"] = commit
    return record


def write_result(out: Path, result: dict[str, Any], shown: Any = None) -> None:
    """Write a benchmark's result as JSON (folders made, indent 2, a closing newline), then print `shown` if given.

    A value JSON cannot hold is written plainly: a non-finite float (a distance to other tokens, a ratio of nothing)
    as null, anything else (a path, a date) as its text. `shown` is what the terminal should see (the summary, or
    the whole result); the file's path is printed last either way.
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(_plain(result), indent=2, allow_nan=False) + "\n")
    if shown is not None:
        print(json.dumps(_plain(shown), indent=2, allow_nan=False))
    print(f"written: {out}", flush=True)


def _plain(value: Any) -> Any:
    """`value` with its non-finite floats as None and what JSON has no type for as text, containers walked."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    if value is None or isinstance(value, str | int | bool):
        return value
    return str(value)


def machine() -> dict[str, Any]:
    """Cores (all, and those this process may run on), the CPU's model, memory, GPUs, kernel and load average."""
    found: dict[str, Any] = {"cores": os.cpu_count(), "usable_cores": len(os.sched_getaffinity(0)),
                             "kernel": f"{platform.system()} {platform.release()}"}
    cpu = _cpu_model()
    if cpu:
        found["cpu"] = cpu
    memory = _memory_gib()
    if memory:
        found["memory_gib"] = memory
    found["gpus"] = gpus()
    driver = gpu_driver() if found["gpus"] else None
    if driver:
        found["gpu_driver"] = driver
    # Other work on the machine moves a benchmark's absolute figures; the load says how busy it was when recorded.
    found["load_average_1m"] = round(os.getloadavg()[0], 2)
    return found


def versions() -> dict[str, str]:
    """Python's version and every installed distribution of DISTRIBUTIONS."""
    found = {"python": platform.python_version()}
    for name in DISTRIBUTIONS:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return found


def gpus() -> list[str]:
    """The GPUs' names: nvidia-smi's, or torch's when it is already imported; none on a CPU machine."""
    if shutil.which("nvidia-smi"):
        try:
            listed = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                    text=True, timeout=30, check=True).stdout
            return [line.strip() for line in listed.splitlines() if line.strip()]
        except (OSError, subprocess.SubprocessError):
            pass
    torch = sys.modules.get("torch")  # importing torch only to ask costs a CPU benchmark seconds
    if torch is not None and torch.cuda.is_available():
        return [torch.cuda.get_device_name(index) for index in range(torch.cuda.device_count())]
    return []


def gpu_driver() -> str | None:
    """The NVIDIA driver's version (nvidia-smi's); None where there is no nvidia-smi or it fails."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        listed = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return next((line.strip() for line in listed.splitlines() if line.strip()), None)


def git_commit() -> dict[str, Any] | None:
    """HEAD of the checkout the benchmark ran from, and whether its tree had changes; None outside a checkout."""
    try:
        head = _git("rev-parse", "HEAD")
        changed = _git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
    return {"sha": head, "dirty": bool(changed)}


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=30,
                          check=True).stdout.strip()


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        return None
    return platform.processor() or None


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        return None
    return None
