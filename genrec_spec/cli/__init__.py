"""The `genrec-spec` command: one subcommand per job, each defined in its own module.

Every subcommand module exposes `add_arguments(parser)` and `run(args) -> int`; this file only
wires them together and turns bad-input errors into one clear line and a non-zero exit code.
Only the module of the subcommand being run is imported, so `genrec-spec --help` stays fast and
no job pays for another's imports (torch, faiss, transformers).
"""

from __future__ import annotations

import argparse
import errno
import importlib
import os
import signal
import sys
import threading

from genrec_spec.memory import keep_freed_memory

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "prepare": (
        "genrec_spec.cli.prepare",
        "raw interactions -> leave-one-out split -> item embeddings -> semantic IDs",
    ),
    "train": ("genrec_spec.cli.train", "train the Semantic-ID recommender on a prepared folder"),
    "recommend": (
        "genrec_spec.cli.recommend",
        "top-K items for one user or history from a checkpoint",
    ),
    "evaluate": (
        "genrec_spec.cli.evaluate",
        "HR/NDCG/MRR@K of a decoder on the valid or test split",
    ),
    "batch": (
        "genrec_spec.cli.batch",
        "batch candidate generation: top-K for many users to parquet shards (local or Ray)",
    ),
    "replay": (
        "genrec_spec.cli.replay",
        "offline A/B replay of two decoders or checkpoints with bootstrap CIs and a report",
    ),
    "serve": ("genrec_spec.cli.serve", "the online retrieval service (FastAPI on uvicorn)"),
    "loadtest": (
        "genrec_spec.cli.loadtest",
        "load-test a running service: p50/p99 latency and requests/s per concurrency",
    ),
    "generate": ("genrec_spec.cli.generate", "LLM text generation with a speculative method"),
    "train-drafter": (
        "genrec_spec.cli.train_drafter",
        "train an LLM drafter (its kinds: train-drafter --help) on the target's own continuations",
    ),
    "bench": (
        "genrec_spec.cli.bench",
        "benchmarks: beam | kernel | q4 | llm | recsys | scale | train, each against a baseline",
    ),
    "gpu-check": (
        "genrec_spec.cli.gpu_check",
        "on a CUDA machine: the GPU tests and the kernel and recommender benchmarks, to files",
    ),
    "demo": ("genrec_spec.cli.demo", "the main job on the embedded default (ML-100K)"),
}

# A command keeps freed memory for reuse (`genrec_spec.memory`) unless its module sets
# `KEEPS_FREED_MEMORY = False` (those holding catalogues of up to 10^7 items in the machine's
# memory) or this environment variable is set (a process sharing its machine, or a measurement
# of both).
RETURN_FREED_MEMORY = "GENREC_SPEC_RETURN_FREED_MEMORY"
# Options whose one value is other options, passed on to another command (`_options_as_values`).
OPTIONS_TAKING_OPTIONS = ("--prepare-options",)

# Errors that mean "the input was wrong": printed as one line, exit code 2. Anything else is a bug
# and keeps its traceback.
USER_ERRORS = (ValueError, FileNotFoundError, FileExistsError, NotADirectoryError, PermissionError)
# File-system errors a path or place given on the command line causes, and what to do: printed
# the same way. Other OSErrors keep their traceback.
PATH_ERRORS = {
    errno.ENAMETOOLONG: "use a shorter path (a name holds at most 255 bytes)",
    errno.ENOSPC: "free space on that disk, or write elsewhere",
    errno.EROFS: "write to a writable file system",
    errno.EISDIR: "pass a file's path there, not a folder's",
}


def add_subcommands(
    parser: argparse.ArgumentParser, table: dict[str, tuple[str, str]], argv: list[str]
) -> None:
    """Add one subparser per entry of `table`; import and configure only the one named in argv."""
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    chosen = next((arg for arg in argv if not arg.startswith("-")), None)
    for name, (module_name, help_text) in table.items():
        cmd = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            module = importlib.import_module(module_name)
            cmd.description = module.__doc__
            cmd.formatter_class = argparse.RawDescriptionHelpFormatter
            if hasattr(module, "COMMANDS"):  # a group of subcommands, e.g. `bench kernel`
                add_subcommands(cmd, module.COMMANDS, argv[argv.index(name) + 1 :])
            else:
                module.add_arguments(cmd)
                keeps = getattr(module, "KEEPS_FREED_MEMORY", True)
                cmd.set_defaults(_run=module.run, _prog=cmd.prog, _keeps_freed_memory=keeps)


def main(argv: list[str] | None = None) -> int:
    # Nothing can be fetched from a model hub here; a hub lookup would only waste time.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    argv = _options_as_values(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="genrec-spec",
        description="Lossless speculative decoding for generative recommenders and LLMs.",
    )
    add_subcommands(parser, COMMANDS, argv)
    args = parser.parse_args(argv)
    if args._keeps_freed_memory and not os.environ.get(RETURN_FREED_MEMORY):
        keep_freed_memory()
    # A plain `kill` (SIGTERM) unwinds like Ctrl-C, so a command's temporary outputs are removed
    # (Python takes signals in its main thread only; a server may install its own handler).
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _interrupt) if main_thread else None
    try:
        return int(args._run(args) or 0)
    except USER_ERRORS as exc:
        print(f"{args._prog}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        if exc.errno not in PATH_ERRORS:
            raise
        print(f"{args._prog}: error: {exc}. Fix: {PATH_ERRORS[exc.errno]}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{args._prog}: interrupted", file=sys.stderr)
        return 130
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)


def _options_as_values(argv: list[str]) -> list[str]:
    """Options whose value is itself another command's options (`bench scale
    --prepare-options --overwrite`) joined to their value: argparse reads a value that starts
    with a dash as the next option, and refuses with "expected one argument"."""
    joined, i = [], 0
    while i < len(argv):
        if argv[i] in OPTIONS_TAKING_OPTIONS and i + 1 < len(argv):
            joined.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            joined.append(argv[i])
            i += 1
    return joined


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
