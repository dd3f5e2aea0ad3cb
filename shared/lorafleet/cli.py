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
