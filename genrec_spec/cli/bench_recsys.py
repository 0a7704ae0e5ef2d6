"""Recommendation decoding benchmark (``genrec-spec bench recsys --ckpt CKPT``).

In one process and one run, on the same users of the held-out split and the same checkpoint,
it times every decoder (``beam``, ``spec_beam`` with its default draft, ``spec-frontier``,
``spec-heads`` and ``spec-nezha`` with its frontier, parallel-heads and NEZHA-head drafts,
``heads``, ``rpg`` (exact below 10^5 items), ``rpg-graph`` walking its item graph at any size,
``nezha``, and ``dense`` where the checkpoint has the item objective) with the same K and the
same beam width (given to every decoder that has one: beam, spec_beam, nezha; by default
beam's own, max(K, 20)).

Columns:
  p50 / p99      latency per request at batch 1 (one user per call), milliseconds
  cpu p50        the same requests' median CPU time (this thread's), which a loaded shared
                 machine inflates less than wall time
  speedup        beam's p50 / this decoder's p50
  passes         sequential backbone passes per request (beam: one per code level)
  nodes          tree nodes scored per request (beam's prefixes, spec_beam's drafts)
  hit            spec_beam's draft hit rate: needed prefixes found in its drafts
  users/s @B     throughput at batch B (median over repeats) and its speedup over beam's
  same           fraction of users whose top-K equals beam's (items and order); spec_beam
                 must be 1.00
  overlap        mean |top-K ∩ beam's top-K| / K

Below the table, two floors timed in the same batch-1 rotation (work, not decoders), each with
the most any decoder of its kind could gain over beam on this machine (beam's p50 / its p50):
  history pass   `encode_history` alone, the first step of every decoder: no decoder that
                 reads the user's history can be faster
  exact floor    the history and every prefix whose scores beam's selection reads (its beams
                 of lengths 1..L-1 with a choice of next code), with their ancestors, in ONE
                 fused pass: an exact decoder must have those scores, so even a free, perfect
                 draft and free selection cannot beat this

Timing: at batch 1 the decoders (and the floors) take turns user by user, the order rotating
every user; at batch B they take turns batch by batch. Drift of this shared machine then hits
every decoder alike. ``--history-cache`` times returning users instead: every decoder reads
histories through a history cache (`recsys.history_cache`, what ``serve`` keeps) holding each
user's history without its newest item, so a request encodes that item only (histories past the
model's context slide and are encoded whole). Each decoder first runs once untimed (warm-up; the
rpg item graph is built there and its build time is reported apart).
``torch.set_num_threads(1)`` by default: one thread is fastest for one small model on 2 cores.
Example:

    genrec-spec bench recsys --ckpt CKPT --users 200 --k 10 --beam-width 20
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from genrec_spec.bench.errors import BenchError
from genrec_spec.bench.recsys import ROWS, BenchRecsysConfig, bench_checkpoint
from genrec_spec.cli.evaluate import add_checkpoint_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    c = BenchRecsysConfig()
    add_checkpoint_arguments(parser)
    parser.add_argument("--split", default=c.split, choices=["valid", "test"])
    parser.add_argument(
        "--decoders",
        help=f"comma-separated, of {','.join(ROWS)} (beam always runs; default: every one "
        "the checkpoint can run, dense only with the item objective)",
    )
    parser.add_argument("--k", type=int, default=c.k, help="recommendations per user")
    parser.add_argument(
        "--beam-width", type=int, default=c.beam_width, help="W >= k (default max(k, 20))"
    )
    parser.add_argument("--users", type=int, help=f"batch-1 users (default {c.users})")
    parser.add_argument("--batch-sizes", help="comma-separated (default 64,256)")
    parser.add_argument("--batches", type=int, default=c.batches, help="batches per size")
    parser.add_argument("--repeats", type=int, help=f"throughput repeats (default {c.repeats})")
    parser.add_argument("--threads", type=int, default=c.threads, help="torch CPU threads")
    parser.add_argument("--device", default=c.device, help="cpu or cuda (model and histories)")
    parser.add_argument("--seed", type=int, default=c.seed, help="draws the users")
    parser.add_argument(
        "--history-cache",
        action="store_true",
        help="time returning users: histories cached without their newest item",
    )
    parser.add_argument("--json", type=Path, help="also write the rows to this JSON file")
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke test: {c.quick_users} users, batch {c.quick_batch_sizes}, one repeat",
    )


def settings_from(args: argparse.Namespace) -> BenchRecsysConfig:
    """The settings of the arguments (`BenchRecsysConfig` checks them)."""
    c = BenchRecsysConfig()

    def pick(value, quick, default):
        return value if value is not None else quick if args.quick else default

    names = tuple(dict.fromkeys(x.strip() for x in (args.decoders or "").split(",") if x.strip()))
    try:
        sizes = tuple(int(x) for x in args.batch_sizes.split(",")) if args.batch_sizes else None
    except ValueError:
        raise BenchError(
            f"--batch-sizes {args.batch_sizes!r} is not a list of integers",
            "give integers like 64,256",
        ) from None
    return replace(
        c,
        decoders=names or None,
        split=args.split,
        k=args.k,
        beam_width=args.beam_width,
        users=pick(args.users, c.quick_users, c.users),
        batch_sizes=pick(sizes, c.quick_batch_sizes, c.batch_sizes),
        batches=args.batches,
        repeats=pick(args.repeats, c.quick_repeats, c.repeats),
        threads=args.threads,
        device=args.device,
        seed=args.seed,
        history_cache=args.history_cache,
    )


def run(args: argparse.Namespace) -> int:
    text, report = bench_checkpoint(
        args.ckpt,
        args.data,
        settings_from(args),
        log=lambda line: print(line, file=sys.stderr, flush=True),
    )
    print(text)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0
