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
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import ssl
import time
from collections import Counter
from contextlib import AsyncExitStack
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from genrec_spec.cli.serve import API_KEY_ENV, is_loopback

MAX_CONCURRENCY = 1024  # most clients of one level (module docstring)


@dataclass(frozen=True)
class LoadtestConfig:
    """Defaults of ``genrec-spec loadtest``."""

    concurrency: tuple[int, ...] = (1, 8, 64)  # concurrent clients, one level each
    seconds: float = 10.0  # duration of each level
    max_requests: int = 100_000  # most requests of one level
    decoder: str = "beam"
    k: int = 10
    exclude_seen: bool = False
    timeout_s: float = 30.0  # a request unanswered this long counts as an error
    warmup: int = 5  # uncounted requests before the first level
    seed: int = 0  # draws the users


class LoadtestError(ValueError):
    """Bad arguments or an unusable service (not loopback, no users)."""


def check_url(url: str) -> str:
    """The URL without a trailing slash; refuses anything but http(s) on a loopback host."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise LoadtestError(f"--url {url!r} must look like http://127.0.0.1:8080")
    if not is_loopback(parts.hostname):
        raise LoadtestError(
            f"--url host {parts.hostname!r} is not a loopback address; loadtest only loads a "
            "service on this machine (127.0.0.1, ::1 or localhost)"
        )
    return url.rstrip("/")


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) by the nearest-rank method; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


async def fetch_users(client, limit: int = 100_000) -> list[str]:
    response = await client.get("/v1/users", params={"limit": limit})
    if response.status_code != 200:
        raise LoadtestError(f"GET /v1/users answered {response.status_code}: {response.text}")
    users = response.json()["users"]
    if not users:
        raise LoadtestError("the service's data has no users to draw from")
    return users


def request_body(users: list[str], config: LoadtestConfig, rng: random.Random) -> dict:
    return {
        "user_id": rng.choice(users),
        "k": config.k,
        "decoder": config.decoder,
        "exclude_seen": config.exclude_seen,
    }


async def run_level(
    clients: list[httpx.AsyncClient], users: list[str], config: LoadtestConfig, rng: random.Random
) -> dict:
    """One closed-loop level: a worker per client (one connection each) until the time or the
    request budget is spent. Workers do not share a client: one client shared by many workers
    spends more CPU in its connection pool than the requests cost, and the client shares the
    CPU with the service under test."""
    latencies: list[float] = []
    errors: Counter[str] = Counter()
    sent = 0
    start = time.perf_counter()
    end = start + config.seconds

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal sent
        while time.perf_counter() < end and sent < config.max_requests:
            sent += 1
            body = request_body(users, config, rng)
            began = time.perf_counter()
            try:
                response = await client.post("/v1/recommend", json=body)
            except Exception as exc:  # a timeout or a dropped connection is a result here
                errors[type(exc).__name__] += 1
                continue
            if response.status_code == 200:
                latencies.append(time.perf_counter() - began)
            else:
                errors[str(response.status_code)] += 1

    await asyncio.gather(*(worker(client) for client in clients))
    elapsed = time.perf_counter() - start
    done = len(latencies) + sum(errors.values())
    return {
        "concurrency": len(clients),
        "requests": done,
        "errors": sum(errors.values()),
        "errors_by_kind": dict(errors),
        "p50_ms": percentile(latencies, 50) * 1e3,
        "p99_ms": percentile(latencies, 99) * 1e3,
        "requests_per_s": done / elapsed,
        "seconds": elapsed,
    }


async def load_test(url: str, config: LoadtestConfig, api_key: str | None) -> list[dict]:
    headers = {"X-API-Key": api_key} if api_key else {}
    rng = random.Random(config.seed)
    make_client = partial(
        httpx.AsyncClient,
        base_url=url,
        headers=headers,
        timeout=config.timeout_s,
        limits=httpx.Limits(max_connections=1),
        verify=ssl.create_default_context(),  # shared: building one per client costs ~70 ms
    )
    results = []
    async with make_client() as c:
        users = await fetch_users(c)
        for _ in range(config.warmup):
            response = await c.post("/v1/recommend", json=request_body(users, config, rng))
            if response.status_code != 200:
                raise LoadtestError(
                    f"a warm-up request answered {response.status_code}: {response.text}"
                )
    for concurrency in config.concurrency:
        async with AsyncExitStack() as stack:  # clients are made before the level's clock starts
            clients = [await stack.enter_async_context(make_client()) for _ in range(concurrency)]
            results.append(await run_level(clients, users, config, rng))
    return results


def format_table(results: list[dict]) -> str:
    lines = [f"{'conc':>5}{'requests':>10}{'errors':>8}{'p50 ms':>10}{'p99 ms':>10}{'req/s':>10}"]
    for r in results:
        lines.append(
            f"{r['concurrency']:>5}{r['requests']:>10}{r['errors']:>8}{r['p50_ms']:>10.1f}"
            f"{r['p99_ms']:>10.1f}{r['requests_per_s']:>10.1f}"
        )
    return "\n".join(lines)


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
    parser.add_argument(
        "--decoder", default=c.decoder, help="beam, heads, rpg, nezha, spec_beam, dense"
    )
    parser.add_argument("--k", type=int, default=c.k)
    parser.add_argument("--exclude-seen", action="store_true", help="leave seen items out")
    parser.add_argument("--timeout-s", type=float, default=c.timeout_s, help="per request")
    parser.add_argument("--warmup", type=int, default=c.warmup, help="uncounted requests")
    parser.add_argument("--seed", type=int, default=c.seed, help="draws the users")
    parser.add_argument("--api-key", help=f"X-API-Key to send (default: ${API_KEY_ENV})")
    parser.add_argument("--json", type=Path, help="also write the results to this JSON file")


def run(args: argparse.Namespace) -> int:
    url = check_url(args.url)
    if not 0 < args.seconds <= 3600 or args.max_requests < 1 or args.timeout_s <= 0:
        raise LoadtestError(
            "--seconds must lie in (0, 3600], --max-requests >= 1 and --timeout-s > 0"
        )
    if args.warmup < 0 or args.k < 1:
        raise LoadtestError("--warmup must be >= 0 and --k >= 1")
    config = LoadtestConfig(
        concurrency=args.concurrency,
        seconds=args.seconds,
        max_requests=args.max_requests,
        decoder=args.decoder,
        k=args.k,
        exclude_seen=args.exclude_seen,
        timeout_s=args.timeout_s,
        warmup=args.warmup,
        seed=args.seed,
    )
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    try:
        results = asyncio.run(load_test(url, config, api_key))
    except httpx.HTTPError as exc:  # the users or warm-up requests failed: no service there
        raise LoadtestError(f"cannot reach {url}: {type(exc).__name__}: {exc}") from None
    print(
        f"{url} /v1/recommend decoder={config.decoder} k={config.k} "
        f"exclude_seen={config.exclude_seen}, {config.seconds:g} s per level"
    )
    print(format_table(results))
    if args.json:
        report = {"url": url, "config": asdict(config), "results": results}
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0
