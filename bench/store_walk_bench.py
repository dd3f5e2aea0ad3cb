"""What the descriptor walk (issue 64) costs one ingest into the content store, side by side with a baseline commit's
store: the same adapter (the tiny model's, LoRA ranks 1 and 16) ingested into a fresh store by each, alternating,
`--samples` times per rank. The baseline's content_store.py is read from git (`--base`), loaded as a module of its
own, and given the path its route resolved; this tree's store is given the path as written. No replica, no proxy:
the ingest alone, which `make bench-store-cost` measures inside a whole publish when the machine is quiet; the
walk's extra time is also given as a share of that kept publish p50 (the store's goals: +10% at rank 1, +20% at 16).

    .venv/bin/python bench/store_walk_bench.py --out bench/results/bench-store-walk.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from lorafleet.adapters import adapter_dir
from lorafleet_ops.docsite.record import RECORD_KEY, run_record, write_result
from lorafleet_ops.tiny_model import make_adapter, make_tiny_model
from lorafleet_proxy import content_store

STORE = "services/proxy/lorafleet_proxy/content_store.py"


def baseline(base: str, folder: Path) -> ModuleType:
    """The baseline commit's content_store.py as a module of its own."""
    path = folder / "baseline_content_store.py"
    path.write_bytes(subprocess.run(["git", "show", f"{base}:{STORE}"], check=True, capture_output=True).stdout)
    spec = importlib.util.spec_from_file_location("baseline_content_store", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def timed(ingest: Callable[[], Any]) -> float:
    started = time.perf_counter()
    ingest()
    return time.perf_counter() - started


def measure(root: Path, source: Path, old: ModuleType, samples: int) -> dict[str, Any]:
    arms: dict[str, list[float]] = {"walk": [], "baseline": []}
    for sample in range(samples):
        for arm in ("walk", "baseline") if sample % 2 == 0 else ("baseline", "walk"):
            store = root / f".content-{arm}"
            shutil.rmtree(store, ignore_errors=True)
            if arm == "walk":
                new = content_store.ContentStore(store, root)
                arms[arm].append(timed(lambda new=new: new.ingest(source.relative_to(root))))
            else:
                was = old.ContentStore(store, root)
                arms[arm].append(timed(lambda was=was: was.ingest(str(source.resolve()))))
    p50 = {arm: statistics.median(times) for arm, times in arms.items()}
    return {"walk_ms_p50": p50["walk"] * 1000, "baseline_ms_p50": p50["baseline"] * 1000,
            "growth": p50["walk"] / p50["baseline"] - 1, "bytes": sum(f.stat().st_size for f in source.iterdir())}


def publish_p50_s(rank: int) -> float | None:
    """The p50 of a whole publish through the store's proxy at `rank`, from the kept `make bench-store-cost` result."""
    try:
        ranks = json.loads(Path("bench/results/bench-store-cost.json").read_text())["ranks"]
    except (OSError, ValueError, KeyError):
        return None
    return next((row["store_s"]["p50"] for row in ranks if row["rank"] == rank), None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="main", help="the commit whose content store is the baseline")
    parser.add_argument("--samples", type=int, default=400)
    parser.add_argument("--out", type=Path, default=Path("bench/results/bench-store-walk.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = make_tiny_model(work / "tiny")
        old = baseline(args.base, work)
        ranks = {}
        for rank in (1, 16):
            root = work / f"adapters-{rank}"
            source = make_adapter(adapter_dir(root, "r", "trl-policy-v1"), model, rank=rank, seed=rank)
            row = {"rank": rank, **measure(root, source, old, args.samples)}
            publish = publish_p50_s(rank)  # what the walk's extra time is worth in a whole publish
            row["publish_ms_p50"] = publish and publish * 1000
            row["growth_of_publish"] = publish and (row["walk_ms_p50"] - row["baseline_ms_p50"]) / (publish * 1000)
            ranks[str(rank)] = row
    base = subprocess.run(["git", "rev-parse", "--short", args.base], check=True, capture_output=True, text=True)
    result = {RECORD_KEY: run_record(), "base": base.stdout.strip(), "samples": args.samples, "ranks": ranks}
    write_result(args.out, result, shown=ranks)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
