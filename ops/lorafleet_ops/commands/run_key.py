"""`lorafleet run-key NAME`: make a run's key, its hash into the run-keys directory, the key printed once.

Standard library only (with lorafleet.run_key_store): `PYTHONPATH=shared:ops python3 -m lorafleet_ops.commands.run_key
NAME` works on a host that has no lorafleet installed, which is how `make train RUN=b` makes a key.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from lorafleet.run_key_store import RunKeyError, provision, write_private
from lorafleet.runs import RUN_NAME_DEFAULT, RunNameError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", help="the run's name (as in /runs/<run>)")
    parser.add_argument("--dir", default=os.environ.get("RUN_KEYS_DIR", ""),
                        help="the run-keys directory the proxy reads (default: $RUN_KEYS_DIR)")
    parser.add_argument("--key-file", type=Path, default=None,
                        help="write the key to this file (mode 0600, for TRAINER_RUN_KEY_FILE) instead of printing it")
    parser.add_argument("--rotate", action="store_true", help="replace the run's existing key")
    parser.add_argument("--run-name", default=os.environ.get("RUN_NAME") or RUN_NAME_DEFAULT,
                        help="the fleet's RUN_NAME, the default run's folder, which no key may be named for "
                        f"(default: $RUN_NAME, else {RUN_NAME_DEFAULT})")


def run(args: argparse.Namespace) -> int:
    """Make the key; print it once (or write it to --key-file). Exit 2 naming what is wrong."""
    if not args.dir:
        print("lorafleet run-key: RUN_KEYS_DIR: not set; give the run-keys directory (--dir or RUN_KEYS_DIR)",
              file=sys.stderr)
        return 2
    try:
        key = provision(Path(args.dir), args.run, rotate=args.rotate, run_name=args.run_name)
    except (RunKeyError, RunNameError) as exc:
        print(f"lorafleet run-key: {exc}", file=sys.stderr)
        return 2
    if args.key_file:
        write_private(args.key_file, key)
        print(f"run {args.run!r}: key written to {args.key_file} (mode 0600), its hash to {Path(args.dir) / args.run}")
    else:
        print(key)  # the one time it is shown: only its hash is kept
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lorafleet run-key", description="Make a run's key: its hash into the "
                                     "run-keys directory, the key printed once (or written to --key-file).")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
