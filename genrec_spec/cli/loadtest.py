"""Load-test a running retrieval service: ``genrec-spec loadtest``.

    genrec-spec loadtest --url http://127.0.0.1:8080 --concurrency 1,8,64 --seconds 10 \\
        --decoder beam --k 10 [--api-key KEY]

For each concurrency C in turn, C workers send ``POST /v1/recommend`` back to back (closed
loop: a worker sends its next request when its last one is answered) for ``--seconds``, and at
most ``--max-requests`` requests per level; a request unanswered after ``--timeout-s`` counts
as an error, so a level lasts at most seconds + timeout. Each request names a user drawn
uniformly (seeded) from the service's own data, fetched once from ``GET /v1/users``. Reported
per level: requests, errors (non-200 answers by status, transport failures by name), p50 and
p99 latency of the answered requests as the client saw them, and requests per second (answers
of any status over the level's wall time). A few warm-up requests go first, uncounted.

Only loopback URLs are accepted (127.0.0.0/8, ::1, localhost): this tool loads one's own
service, never someone else's. The client runs on the same machine as the service and shares its
CPU: on a small machine its numbers are a lower bound of the service's capacity. A level has at
most ``MAX_CONCURRENCY`` (1024) clients: each holds its own connection (a file descriptor on both
sides) and all are opened before the level starts, and far past the service's --max-queue (256
by default) a level would measure only 503s.

See `genrec_spec.serve.loadtest`.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from genrec_spec.cli.args import config_from_args
from genrec_spec.recsys.decoders.registry import decoder_names
from genrec_spec.serve.config import API_KEY_ENV
from genrec_spec.serve.loadtest import (
    MAX_CONCURRENCY,
    LoadtestConfig,
    format_report,
    run_loadtest,
)


def _concurrency_levels(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list") from None
    if not values or min(values) < 1 or max(values) > MAX_CONCURRENCY:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give one or more counts from 1 to {MAX_CONCURRENCY} (the most clients "
            "one level may open)"
        )
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    c = LoadtestConfig()
    parser.add_argument("--url", required=True, help="the service, e.g. http://127.0.0.1:8080")
    parser.add_argument(
        "--concurrency",
        type=_concurrency_levels,
        default=c.concurrency,
        help=f"clients of each level, e.g. 1,8,64 (at most {MAX_CONCURRENCY})",
    )
    parser.add_argument("--seconds", type=float, default=c.seconds, help="per level")
    parser.add_argument("--max-requests", type=int, default=c.max_requests, help="per level")
    parser.add_argument("--decoder", default=c.decoder, help=f"one of {decoder_names()}")
    parser.add_argument("--k", type=int, default=c.k)
    parser.add_argument("--exclude-seen", action="store_true", help="leave seen items out")
    parser.add_argument("--timeout-s", type=float, default=c.timeout_s, help="per request")
    parser.add_argument("--warmup", type=int, default=c.warmup, help="uncounted requests")
    parser.add_argument("--seed", type=int, default=c.seed, help="draws the users")
    parser.add_argument("--api-key", help=f"X-API-Key to send (default: ${API_KEY_ENV})")
    parser.add_argument("--json", type=Path, help="also write the results to this JSON file")


def run(args: argparse.Namespace) -> int:
    config = config_from_args(LoadtestConfig, args)
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    report = run_loadtest(args.url, config, api_key)
    print(format_report(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0
