"""Load-test a running retrieval service (``genrec-spec loadtest``, whose help describes the
method): `run_loadtest` fetches the service's users, sends a few uncounted warm-up requests, then
runs one closed-loop level per concurrency (`run_level`: each client its own connection, every
client sends its next request when its last one is answered) and returns the report.

Only loopback URLs are accepted (`check_url`): this tool loads one's own service, never someone
else's. A level has at most ``MAX_CONCURRENCY`` clients: each holds its own connection (a file
descriptor on both sides) and all are opened before the level starts, and far past the
service's queue limit a level would measure only 503s.
"""

from __future__ import annotations

import asyncio
import math
import random
import ssl
import time
from collections import Counter
from contextlib import AsyncExitStack
from dataclasses import asdict, dataclass
from functools import partial
from urllib.parse import urlsplit

import httpx

from genrec_spec.errors import GenrecError
from genrec_spec.serve.config import API_KEY_HEADER, is_loopback

MAX_CONCURRENCY = 1024  # most clients of one level (module docstring)


class LoadtestError(GenrecError):
    """Bad arguments or an unusable service (not loopback, no users)."""


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

    def __post_init__(self) -> None:
        if not 0 < self.seconds <= 3600 or self.max_requests < 1 or self.timeout_s <= 0:
            raise LoadtestError(
                f"--seconds {self.seconds}, --max-requests {self.max_requests} or --timeout-s "
                f"{self.timeout_s} is out of range",
                "--seconds must lie in (0, 3600], --max-requests >= 1 and --timeout-s > 0",
            )
        if self.warmup < 0 or self.k < 1:
            raise LoadtestError(
                f"--warmup {self.warmup} or --k {self.k} is out of range",
                "--warmup must be >= 0 and --k >= 1",
            )


def check_url(url: str) -> str:
    """The URL without a trailing slash; refuses anything but http(s) on a loopback host."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise LoadtestError(
            f"--url {url!r} is not an http(s) URL with a host",
            "give one like http://127.0.0.1:8080",
        )
    if not is_loopback(parts.hostname):
        raise LoadtestError(
            f"--url host {parts.hostname!r} is not a loopback address",
            "loadtest only loads a service on this machine: use 127.0.0.1, ::1 or localhost",
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
        raise LoadtestError(
            f"GET /v1/users answered {response.status_code}: {response.text}",
            "check the service's URL and API key (--api-key)",
        )
    users = response.json()["users"]
    if not users:
        raise LoadtestError(
            "the service's data has no users to draw from",
            "serve a checkpoint whose data has users",
        )
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
    headers = {API_KEY_HEADER: api_key} if api_key else {}
    rng = random.Random(config.seed)
    make_client = partial(
        httpx.AsyncClient,
        base_url=url,
        headers=headers,
        timeout=config.timeout_s,
        limits=httpx.Limits(max_connections=1),
        verify=ssl.create_default_context(),  # shared: building one per client is slow
    )
    results = []
    async with make_client() as c:
        users = await fetch_users(c)
        for _ in range(config.warmup):
            response = await c.post("/v1/recommend", json=request_body(users, config, rng))
            if response.status_code != 200:
                raise LoadtestError(
                    f"a warm-up request answered {response.status_code}: {response.text}",
                    "check the decoder and k against the service (GET /openapi.json)",
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


def run_loadtest(url: str, config: LoadtestConfig, api_key: str | None = None) -> dict:
    """Load-test the service at `url` (loopback only), level by level: the report, with the
    url, the config and one result per concurrency level."""
    url = check_url(url)
    try:
        results = asyncio.run(load_test(url, config, api_key))
    except httpx.HTTPError as exc:  # the users or warm-up requests failed: no service there
        raise LoadtestError(
            f"cannot reach {url}: {type(exc).__name__}: {exc}",
            "start the service (`genrec-spec serve`) or correct --url",
        ) from None
    return {"url": url, "config": asdict(config), "results": results}


def format_report(report: dict) -> str:
    """What was asked and the table of results."""
    c = report["config"]
    head = (
        f"{report['url']} /v1/recommend decoder={c['decoder']} k={c['k']} "
        f"exclude_seen={c['exclude_seen']}, {c['seconds']:g} s per level"
    )
    return head + "\n" + format_table(report["results"])
