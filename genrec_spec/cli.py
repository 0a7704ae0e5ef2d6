"""The `genrec-spec` command: one subcommand per job, each defined in its own module.

Every subcommand module exposes `add_arguments(parser)` and `run(args) -> int`; this file only
wires them together and turns bad-input errors into one clear line and a non-zero exit code.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# name -> (module, one-line help). A subcommand module keeps its heavy imports (torch, faiss,
# transformers) inside `run`, so that `genrec-spec --help` stays fast.
COMMANDS: dict[str, tuple[str, str]] = {
    "prepare": (
        "genrec_spec.data_pipelines.prepare",
        "raw interactions -> leave-one-out split -> item embeddings -> semantic IDs",
    ),
    "demo": ("genrec_spec.demo", "the main job on the embedded default (ML-100K)"),
}

# Errors that mean "the input was wrong": printed as one line, exit code 2. Anything else is a bug
# and keeps its traceback.
USER_ERRORS = (ValueError, FileNotFoundError, FileExistsError, NotADirectoryError, PermissionError)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="genrec-spec",
        description="Lossless speculative decoding for generative recommenders and LLMs.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module_name, help_text) in COMMANDS.items():
        module = importlib.import_module(module_name)
        cmd = sub.add_parser(name, help=help_text, description=module.__doc__)
        module.add_arguments(cmd)
        cmd.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    # Nothing can be fetched from a model hub here; a hub lookup would only waste time.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    args = build_parser().parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except USER_ERRORS as exc:
        print(f"genrec-spec {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"genrec-spec {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
