"""The `lorafleet` command: status, doctor, demo, and the offline model/adapter builders."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lorafleet.settings import ConfigError


def _make_tiny_model(args: argparse.Namespace) -> int:
    from lorafleet.tiny import make_tiny_model

    print(make_tiny_model(args.dir, seed=args.seed))
    return 0


def _make_adapter(args: argparse.Namespace) -> int:
    from lorafleet.tiny import make_adapter

    print(make_adapter(args.dir, args.model, rank=args.rank, seed=args.seed))
    return 0


def _status(args: argparse.Namespace) -> int:
    from lorafleet.settings import load_settings
    from lorafleet.status import fetch_fleet, fleet_endpoint, read_metrics, render_status

    settings = load_settings()
    url, token = fleet_endpoint(settings)
    url = args.url or url
    try:
        fleet = fetch_fleet(url, token)
    except Exception as exc:  # any transport or HTTP error: say where we looked and why it failed
        print(f"lorafleet status: cannot read {url}/fleet: {exc}", file=sys.stderr)
        return 1
    print(render_status(fleet, url, read_metrics(settings.run_dir / "metrics.jsonl")))
    return 0


def _demo(args: argparse.Namespace) -> int:
    from lorafleet.demo import DemoOptions
    from lorafleet.demo import main as demo_main

    return demo_main(DemoOptions(out=args.out, replicas=args.replicas, steps=args.steps))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lorafleet", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    tiny = commands.add_parser("make-tiny-model", help="build the offline tiny Qwen2 model (seconds, no download)")
    tiny.add_argument("dir", type=Path)
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(func=_make_tiny_model)

    adapter = commands.add_parser("make-adapter", help="write a real PEFT LoRA adapter with non-zero weights")
    adapter.add_argument("dir", type=Path)
    adapter.add_argument("--model", type=Path, required=True, help="model directory the adapter is for")
    adapter.add_argument("--rank", type=int, default=1)
    adapter.add_argument("--seed", type=int, default=0)
    adapter.set_defaults(func=_make_adapter)

    status = commands.add_parser("status", help="readable table of the running fleet (the proxy's /fleet)")
    status.add_argument("--url", default="", help="proxy URL (default: public port with PROXY_API_KEY, else fleet)")
    status.set_defaults(func=_status)

    demo = commands.add_parser("demo", help="CPU demo: tiny model, replicas, proxy, real trainer; writes a report")
    demo.add_argument("--out", type=Path, default=Path("results/demo"))
    demo.add_argument("--replicas", type=int, default=2)
    demo.add_argument("--steps", type=int, default=30)
    demo.set_defaults(func=_demo)
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
