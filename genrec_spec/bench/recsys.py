"""Recommendation decoding benchmark (``genrec-spec bench recsys``; its help explains the table).

    rows, floors = benchmark(model, histories, BenchRecsysConfig(...))
    text, report = bench_checkpoint(ckpt, data_dir, BenchRecsysConfig(...))

In one process and one run, on the same users of a held-out split, every benchmark row (each
registered decoder, and variants of some with fixed options: `VARIANTS`) is timed with the same
K and beam width: batch-1 latency (p50, p99, CPU time), throughput at each batch size, and its
lists against beam's. Two floors, work rather than decoders, are timed in the same batch-1
rotation: the history pass alone, and the history with every prefix beam's selection reads in
one fused pass (no exact decoder can beat it). The decoders take turns user by user (batch by
batch for throughput), the order rotating, so drift of a shared machine hits each alike; with
`history_cache` every row reads histories through a history cache holding each user's history
without its newest item (returning users). Each row first runs once untimed (warm-up).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from genrec_spec.bench.errors import BenchError
from genrec_spec.machine import describe_device, finish
from genrec_spec.recsys.checkpoint import load_model_and_data
from genrec_spec.recsys.data import sample_users
from genrec_spec.recsys.decoders.beam import beam_width_for, search
from genrec_spec.recsys.decoders.registry import DECODERS, get_decoder, options_for, runs_on
from genrec_spec.recsys.history_cache import HistoryCache, rows_of
from genrec_spec.recsys.item_trie import item_trie
from genrec_spec.recsys.scoring import PrefixTree, TrieIndex, prefix_tree
from genrec_spec.recsys.types import RecommendStats

# Benchmark rows that are a registered decoder with fixed options.
VARIANTS: dict[str, tuple[str, dict]] = {
    # beam's own level-by-level search, the reference of the core's (the same lists)
    "beam-native": ("beam", {"engine": "native"}),
    # rpg's graph walk forced (its default walks only catalogues of 10^5 items and more)
    "rpg-graph": ("rpg", {"mode": "graph"}),
    # spec_beam with its other drafts (its default, "auto", drafts "items" on models with the
    # item objective): the whole first code level scored with the history; the parallel heads'
    # most probable prefixes; the NEZHA head's beam
    "spec-frontier": ("spec_beam", {"draft": "frontier"}),
    "spec-heads": ("spec_beam", {"draft": "heads"}),
    "spec-nezha": ("spec_beam", {"draft": "nezha"}),
    # spec_beam's default draft on beam's own level-by-level search (the same lists)
    "spec-native": ("spec_beam", {"engine": "native"}),
}
# Every registered decoder, each followed by its variants.
ROWS = tuple(
    row
    for name in DECODERS
    for row in (name, *(v for v, (base, _) in VARIANTS.items() if base == name))
)


def decoder_of(row: str) -> str:
    """The registered decoder a benchmark row runs (a variant's, else the row's own name)."""
    return VARIANTS.get(row, (row,))[0]


def decoders_of(model) -> tuple[str, ...]:
    """Every benchmark row the checkpoint can run (the model has what its decoder needs)."""
    return tuple(n for n in ROWS if runs_on(model, decoder_of(n)))


@dataclass(frozen=True)
class BenchRecsysConfig:
    """Defaults of ``genrec-spec bench recsys``."""

    # "beam" is always run: it is the baseline; None = every row the checkpoint can run
    decoders: tuple[str, ...] | None = None
    split: str = "test"
    k: int = 10
    beam_width: int | None = None  # of beam, spec_beam and nezha; None = beam's max(k, 20)
    users: int = 200  # users timed at batch 1 (a fixed random subset of the split)
    batch_sizes: tuple[int, ...] = (64, 256)
    batches: int = 2  # batches per batch size and repeat (same users for every decoder)
    repeats: int = 3  # throughput repeats (median)
    threads: int = 1
    device: str = "cpu"  # where the model and histories live ("cuda" for a GPU)
    seed: int = 0
    # Time returning users: each decoder reads histories through a history cache that holds
    # every user's history without its last item (their previous request).
    history_cache: bool = False
    # --quick: a smoke test of every decoder and both timings in seconds.
    quick_users: int = 4
    quick_batch_sizes: tuple[int, ...] = (3,)
    quick_repeats: int = 1

    def __post_init__(self) -> None:
        unknown = [n for n in self.decoders or () if n not in ROWS]
        if unknown:
            raise BenchError(f"unknown decoders {unknown}", f"choose from {','.join(ROWS)}")
        counts = (self.k, self.users, self.batches, self.repeats, self.threads)
        if not self.batch_sizes or min(counts + self.batch_sizes) < 1:
            raise BenchError(
                f"--k {self.k}, --users {self.users}, --batches {self.batches}, --repeats "
                f"{self.repeats}, --threads {self.threads}, --batch-sizes {self.batch_sizes}",
                "give each a value >= 1",
            )
        if self.beam_width is not None and self.beam_width < self.k:
            raise BenchError(
                f"--beam-width {self.beam_width} is below --k {self.k}",
                f"pass --beam-width >= {self.k} or leave it unset",
            )


@dataclass(frozen=True)
class Row:
    decoder: str
    p50_ms: float
    p99_ms: float
    cpu_p50_ms: float  # median CPU time of this thread per batch-1 request
    speedup: float  # beam's p50 / p50
    passes: float  # sequential backbone passes per batch-1 request
    nodes: float  # tree nodes scored per batch-1 request
    hit_rate: float | None  # mean draft hit rate per batch-1 request (drafting decoders only)
    users_per_s: dict[int, float]  # batch size -> median throughput
    throughput_speedup: dict[int, float]  # batch size -> over beam
    same_as_beam: float  # fraction of batch-1 users with beam's exact top-K
    overlap: float  # mean |top-K ∩ beam's| / K


@dataclass(frozen=True)
class Floors:
    """Batch-1 p50s of work every decoder of a kind must do (module docstring)."""

    history_ms: float  # the history pass alone
    exact_ms: float  # the history and beam's prefixes in one fused pass
    exact_nodes: float  # tree nodes per request in that pass


def make_decoders(names: tuple[str, ...], beam_width: int) -> dict:
    """name -> decode(model, values, offsets, *, k, trie, times) with the row's options
    bound."""
    runners = {}
    for name in names:
        base, options = VARIANTS.get(name, (name, {}))
        decode = get_decoder(base)
        options = options | options_for(decode, {"beam_width": beam_width})

        def bound(model, values, offsets, *, k, trie, times=None, _decode=decode, _options=options):
            return _decode(model, values, offsets, k=k, trie=trie, times=times, **_options)

        runners[name] = bound
    return runners


def _rotations(names: list[str], turn: int) -> list[str]:
    return names[turn % len(names) :] + names[: turn % len(names)]


def returning_users(model, users, names: list[str]) -> dict:
    """name -> the model seen through a history cache of its own (`recsys.history_cache`) that
    holds each user's history without its last item, as their previous request left it: a
    timed request then encodes only its newest item (a history past the context slides, so it is
    encoded whole)."""
    previous = [row[:-1] for row in rows_of(users.values, users.offsets)]
    views = {}
    for name in names:
        cache = HistoryCache(model, max_bytes=1 << 40)  # holds every user asked for
        cache.encode_rows(previous)
        views[name] = cache.recommender
    return views


def _timed(decode, model, users, k, trie):
    """(wall seconds, CPU seconds of this thread, Recommendations) of one call."""
    start, cpu = time.perf_counter(), time.thread_time()
    out = decode(model, users.values, users.offsets, k=k, trie=trie, times=users.history_times())
    finish(users.values.device)
    return time.perf_counter() - start, time.thread_time() - cpu, out


@torch.inference_mode()
def _timed_floor(name: str, model, users, prefixes: PrefixTree) -> float:
    """Wall seconds of one floor's work (module docstring) for `users`."""
    times = users.history_times()
    start = time.perf_counter()
    if name == "history":
        model.encode_history(users.values, users.offsets, times)
    else:
        model.encode_history_and_tree(
            users.values, users.offsets, prefixes.codes, prefixes.levels, prefixes.parents, times
        )
    finish(users.values.device)
    return time.perf_counter() - start


def needed_prefixes(model, users, trie, width: int) -> PrefixTree:
    """The prefixes whose scores beam's selection reads for `users` (its beams of lengths
    1..L-1 with a choice of next code: `TrieIndex.to_score`), with their ancestors, as one tree
    per row."""
    index = TrieIndex.of(trie)
    with torch.inference_mode():
        state = model.encode_history(users.values, users.offsets, users.history_times())
        history, _, _ = search(model, state, trie, width)
    nodes = torch.cat([beams.nodes for beams in history[:-1]], dim=1)  # [B, (L-1) W]
    return prefix_tree(index, index.scored(index.rowwise(nodes), index.to_score(model)), len(nodes))


@dataclass
class _Batch1:
    """The batch-1 rotation's measurements, per decoder and per floor."""

    latency: dict[str, list[float]]  # wall seconds per request
    cpu: dict[str, list[float]]  # this thread's CPU seconds per request
    stats: dict[str, list[RecommendStats]]  # each request's decoder stats
    lists: dict[str, list[torch.Tensor]]  # each request's [1, K] items
    floors: dict[str, list[float]]  # floor -> wall seconds per request
    exact_nodes: list[int]  # the exact floor's tree nodes per request


def benchmark(
    model, histories, settings: BenchRecsysConfig, log=lambda line: None
) -> tuple[list[Row], Floors]:
    """Every decoder of `settings` on the same users of `histories` (a split with its users
    already chosen): batch-1 latency over settings.users users, throughput at each batch size;
    and the floors, timed with the batch-1 requests."""
    trie = item_trie(model)
    names = ["beam"] + [n for n in settings.decoders or decoders_of(model) if n != "beam"]
    width = beam_width_for(settings.k, settings.beam_width, model.num_items)
    runners = make_decoders(tuple(names), width)
    first = histories.select(torch.tensor([0]))
    for name in names:  # untimed warm-up: first-call allocations, the rpg item graph
        out = _timed(runners[name], model, first, settings.k, trie)[2]
        if out.stats.graph_build_s is not None:
            log(f"{name}: item graph built in {out.stats.graph_build_s:.2f} s (once per model)")
    one_by_one = _time_batch1(model, histories, settings, runners, trie, width, log)
    throughput = _time_throughput(model, histories, settings, runners, trie, log)
    beam_items = torch.cat(one_by_one.lists["beam"])  # [U, K]
    beam_p50 = statistics.median(one_by_one.latency["beam"])
    rows = []
    for name in names:
        latency, stats = one_by_one.latency[name], one_by_one.stats[name]
        items = torch.cat(one_by_one.lists[name])
        shared = (items[:, :, None] == beam_items[:, None, :]) & (items[:, :, None] >= 0)
        p50 = statistics.median(latency)
        hits = [s.draft_hit_rate for s in stats if s.draft_hit_rate is not None]
        rows.append(
            Row(
                decoder=name,
                p50_ms=p50 * 1e3,
                p99_ms=_percentile(latency, 0.99) * 1e3,
                cpu_p50_ms=statistics.median(one_by_one.cpu[name]) * 1e3,
                speedup=beam_p50 / p50,
                passes=statistics.mean(s.target_passes for s in stats),
                nodes=statistics.mean(s.nodes_scored for s in stats),
                hit_rate=statistics.mean(hits) if hits else None,
                users_per_s=throughput[name],
                throughput_speedup={
                    s: throughput[name][s] / throughput["beam"][s] for s in throughput[name]
                },
                same_as_beam=float((items == beam_items).all(dim=1).float().mean()),
                overlap=float(shared.any(dim=2).float().sum(dim=1).mean() / settings.k),
            )
        )
    return rows, Floors(
        history_ms=statistics.median(one_by_one.floors["history"]) * 1e3,
        exact_ms=statistics.median(one_by_one.floors["exact"]) * 1e3,
        exact_nodes=statistics.mean(one_by_one.exact_nodes),
    )


def _views(model, users, names: list[str], history_cache: bool) -> dict:
    """name -> what it reads the users' histories from: the model, or a history cache of its
    own holding each user's previous request (`returning_users`)."""
    if history_cache:
        return returning_users(model, users, names)
    return dict.fromkeys(names, model)


def _time_batch1(model, histories, settings, runners: dict, trie, width: int, log) -> _Batch1:
    """Every decoder and floor on one user per call, taking turns user by user."""
    names = list(runners)
    floors = {"history": [], "exact": []}
    run = _Batch1(
        latency={n: [] for n in names},
        cpu={n: [] for n in names},
        stats={n: [] for n in names},
        lists={n: [] for n in names},
        floors=floors,
        exact_nodes=[],
    )
    batch1 = min(settings.users, len(histories))
    users = histories.select(torch.arange(batch1))
    target = _views(model, users, names + list(floors), settings.history_cache)
    for user in range(batch1):
        one = histories.select(torch.tensor([user]))
        prefixes = needed_prefixes(model, one, trie, width)  # untimed: the exact floor's tree
        run.exact_nodes.append(prefixes.real_nodes)
        for name in _rotations(names + list(floors), user):
            if name in floors:
                floors[name].append(_timed_floor(name, target[name], one, prefixes))
                continue
            seconds, cpu_seconds, out = _timed(runners[name], target[name], one, settings.k, trie)
            run.latency[name].append(seconds)
            run.cpu[name].append(cpu_seconds)
            run.stats[name].append(out.stats)
            run.lists[name].append(out.items)
        if (user + 1) % 50 == 0:
            log(f"batch 1: {user + 1}/{batch1} users")
    return run


def _time_throughput(model, histories, settings, runners: dict, trie, log) -> dict:
    """name -> {batch size: median users/s over the repeats}, taking turns batch by batch."""
    names = list(runners)
    throughput = {n: {} for n in names}
    for size in settings.batch_sizes:
        count = min(len(histories), size * settings.batches)
        parts = [histories.select(p) for p in torch.arange(count).split(size)]
        repeats = {n: [] for n in names}
        for repeat in range(settings.repeats):
            seconds = {n: 0.0 for n in names}
            for b, part in enumerate(parts):
                # Fresh caches: every repeat times returning users.
                target = _views(model, part, names, settings.history_cache)
                for name in _rotations(names, repeat * len(parts) + b):
                    seconds[name] += _timed(runners[name], target[name], part, settings.k, trie)[0]
            for name in names:
                repeats[name].append(count / seconds[name])
            log(f"batch {size} repeat {repeat + 1}/{settings.repeats} done")
        throughput = {n: throughput[n] | {size: statistics.median(repeats[n])} for n in names}
    return throughput


def _percentile(values: list[float], q: float) -> float:
    """The q-quantile by linear interpolation (statistics.quantiles needs 2+ values)."""
    return float(torch.tensor(values, dtype=torch.float64).quantile(q))


def format_table(rows: list[Row], batch_sizes: tuple[int, ...]) -> str:
    head = f"{'decoder':<14}{'p50 ms':>8}{'p99 ms':>8}{'cpu p50':>8}{'speedup':>9}{'passes':>7}"
    head += f"{'nodes':>7}{'hit':>6}"
    head += "".join(f"{f'users/s@{s}':>14}{'speedup':>9}" for s in batch_sizes)
    lines = [head + f"{'same':>6}{'overlap':>9}"]
    for r in rows:
        line = f"{r.decoder:<14}{r.p50_ms:>8.2f}{r.p99_ms:>8.2f}{r.cpu_p50_ms:>8.2f}"
        line += f"{r.speedup:>8.2f}x{r.passes:>7.2f}{r.nodes:>7.0f}"
        line += f"{r.hit_rate:>6.2f}" if r.hit_rate is not None else f"{'-':>6}"
        for s in batch_sizes:
            line += f"{r.users_per_s[s]:>14.1f}{r.throughput_speedup[s]:>8.2f}x"
        lines.append(line + f"{r.same_as_beam:>6.2f}{r.overlap:>9.2f}")
    return "\n".join(lines)


def format_floors(floors: Floors, beam_p50_ms: float) -> str:
    history, exact = floors.history_ms, floors.exact_ms
    return (
        f"floors at batch 1 (beam's p50 over them: the most a decoder of the kind can gain here):\n"
        f"  history pass alone: p50 {history:.2f} ms, {beam_p50_ms / history:.2f}x "
        "(any decoder that reads the history)\n"
        f"  exact floor, the history and the {floors.exact_nodes:.0f} prefixes beam reads in one "
        f"pass: p50 {exact:.2f} ms, {beam_p50_ms / exact:.2f}x (any decoder of beam's exact output)"
    )


def bench_checkpoint(
    ckpt: Path | str,
    data_dir: Path | str | None,
    settings: BenchRecsysConfig,
    log: Callable[[str], None] = lambda line: None,
) -> tuple[str, dict]:  # (the printed report, the JSON report)
    """`benchmark` on a checkpoint's split: the users drawn, the machine's load around the run,
    and the report as text (a header, the table, the floors) and as JSON."""
    torch.set_num_threads(settings.threads)
    model, data = load_model_and_data(ckpt, data_dir)
    model = model.to(settings.device)
    split = getattr(data, settings.split)
    needed = max(settings.users, max(settings.batch_sizes) * settings.batches)
    histories = split.select(sample_users(len(split), needed, settings.seed)).to(settings.device)
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    rows, floors = benchmark(model, histories, settings, log)
    load_after = os.getloadavg()[0]
    width = beam_width_for(settings.k, settings.beam_width, model.num_items)
    lines = [
        f"{data.manifest.get('name', data.path)} {settings.split} split, {model.num_items} "
        f"items, K={settings.k}, beam width {width}, {describe_device(settings.device)}: "
        f"batch 1 over "
        f"{min(settings.users, len(histories))} users, throughput "
        f"{settings.batches} batch(es) per size, median of {settings.repeats}; "
        f"{time.perf_counter() - started:.0f} s, load average {load_before:.2f} -> "
        f"{load_after:.2f}"
    ]
    if settings.history_cache:
        lengths = histories.offsets.diff()[: settings.users]
        slid = int((lengths > model.config.max_len).sum())
        lines.append(
            f"returning users through a history cache: {len(lengths) - slid} histories extended "
            f"by their newest item, {slid} longer than the context ({model.config.max_len}) "
            "encoded whole"
        )
    lines += [format_table(rows, settings.batch_sizes), format_floors(floors, rows[0].p50_ms)]
    report = {
        "ckpt": str(ckpt),
        "settings": asdict(settings),
        "load_average": [load_before, load_after],
        "rows": [asdict(r) for r in rows],
        "floors": asdict(floors),
    }
    return "\n".join(lines), report
