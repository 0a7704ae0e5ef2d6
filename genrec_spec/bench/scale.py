"""Cost against catalogue size (``genrec-spec bench scale``).

    report = bench_scale(BenchScaleConfig(sizes=(10_000, 100_000)), log=print)

For each synthetic catalogue size N (`genrec-spec prepare --dataset synthetic:N`, prepared once
under --data-root and reused, `bench.scale_prepare`):

  prepare        wall time and peak memory (max RSS) of the prepare process
  trie           build time of the catalogue trie (`PrefixTrie.from_codes`, median of repeats)
                 and its bytes per item (every tensor of the trie)
  model          bytes of the parameters and buffers of a RANDOM-WEIGHT model of the default
                 config (`RecommenderConfig()`) built on the catalogue: enough for speed, not
                 for quality. Its item table is, by default, a fixed random projection of the
                 catalogue's own item embeddings to the model width (`item_table="embeddings"`),
                 so that items cluster as a trained table's do; a table of random rows has no
                 structure for an index to find (`item_table="random"`)
  index          build time of the approximate item index (`recsys.item_index`) and its
                 recall@K against the exact product, on the users timed
  latency        per decoder (`beam`, `spec_beam`, `dense` with the exact product and through
                 the index: `dense-index`), beam width and batch size: the median over repeats
                 of the seconds per call, each repeat on other users of the test split, the
                 decoders taking turns call by call (drift of a shared machine hits each alike);
                 throughput is batch / latency. `dense` has no beam, so one width.

A cell whose tied levels would gather more than `max_gather_gib` of item windows is skipped
and says so. Each cell's first call is untimed; one over `max_call_s` is made again (a
decoder's first call at a size builds what it caches, such as the item index of `spec_beam`'s
draft), and a cell whose second call is over it too is not repeated (that call is reported).
"""

from __future__ import annotations

import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from genrec_spec.bench.errors import BenchError
from genrec_spec.bench.scale_prepare import PrepareCost, check_prepare_options, prepared_catalogue
from genrec_spec.data_pipelines.atomic import check_writable_folder
from genrec_spec.data_pipelines.prepare import MAX_LEVELS
from genrec_spec.data_pipelines.synthetic import SyntheticConfig, users_for
from genrec_spec.machine import describe_device, finish
from genrec_spec.recsys.item_index import KINDS as INDEX_KINDS
from genrec_spec.recsys.item_index import ItemIndexConfig

DECODERS = ("beam", "spec_beam", "dense", "dense-index")
ITEM_TABLES = ("embeddings", "random")
# The random model's code levels: the default config's (level 0 from the item softmax, levels
# 1.. tied to it: both read every item under a prefix), or TIGER's plain code heads (a head per
# level over its codebook: trie-bounded), the item objective kept for dense and the items draft.
MODELS = ("default", "code-heads")


@dataclass(frozen=True)
class BenchScaleConfig:
    """Defaults of ``genrec-spec bench scale``."""

    sizes: tuple[int, ...] = (10_000, 100_000, 1_000_000)  # catalogue sizes N
    data_root: str | None = None  # where catalogues are prepared and reused; None: a temp dir
    # Semantic-ID levels at every size (the targets compare like with like); None: prepare's
    # own choice by catalogue size
    levels: int | None = 3
    prepare_options: tuple[str, ...] = ()  # other arguments of `genrec-spec prepare`
    decoders: tuple[str, ...] = DECODERS
    beam_widths: tuple[int, ...] = (20, 200, 512)
    batch_sizes: tuple[int, ...] = (1, 64)
    k: int = 10
    repeats: int = 5  # timed calls per cell, each on other users (median)
    recall_users: int = 256  # users the index's recall is measured on
    item_table: str = "embeddings"  # the random model's item table: "embeddings" or "random"
    index_kind: str = ItemIndexConfig.kind  # the item index dense-index searches (its KINDS)
    model: str = "default"  # the random model's code levels: "default" or "code-heads"
    # Skip a cell whose tied levels would gather more than this; None: 4 GiB on a CPU, a quarter
    # of the memory of a GPU (`gather_limit_gib`)
    max_gather_gib: float | None = None
    max_call_s: float = 30.0  # a cell whose first two calls take longer is not repeated
    threads: int = 1  # torch and faiss CPU threads
    seed: int = 0
    # Where the model, trie and histories live ("cuda" for a GPU); the item index stays in
    # faiss on the CPU (a query crosses to it and back)
    device: str = "cpu"

    def __post_init__(self) -> None:
        unknown = sorted(set(self.decoders) - set(DECODERS))
        if (
            unknown
            or self.item_table not in ITEM_TABLES
            or self.model not in MODELS
            or self.index_kind not in INDEX_KINDS
        ):
            raise BenchError(
                f"unknown decoders {unknown}, item table {self.item_table!r}, model "
                f"{self.model!r} or index kind {self.index_kind!r}",
                f"choose decoders from {','.join(DECODERS)}, a table from {ITEM_TABLES}, a "
                f"model from {MODELS} and an index kind from {INDEX_KINDS}",
            )
        counts = self.sizes + self.beam_widths + self.batch_sizes
        counts += (self.k, self.repeats, self.recall_users, self.threads)
        if not (self.sizes and self.beam_widths and self.batch_sizes) or min(counts) < 1:
            raise BenchError(
                f"sizes {self.sizes}, widths {self.beam_widths}, batches {self.batch_sizes}, "
                f"k {self.k}, repeats {self.repeats}, recall users {self.recall_users}, "
                f"threads {self.threads}",
                "give non-empty lists and values >= 1",
            )
        if min(self.beam_widths) < self.k:
            raise BenchError(
                f"beam widths {self.beam_widths} must be >= k = {self.k}",
                f"pass --beam-widths of at least {self.k}",
            )
        if not self.decoders or len(set(self.sizes)) < len(self.sizes):
            raise BenchError(
                f"decoders {self.decoders} and sizes {self.sizes}",
                "name at least one decoder, and each size once",
            )
        cores = os.cpu_count() or 1
        if self.threads > cores:
            raise BenchError(f"--threads {self.threads} on {cores} cores", f"use 1 to {cores}")
        gib = self.max_gather_gib
        if (gib is not None and not 0 <= gib < math.inf) or not 0 < self.max_call_s < math.inf:
            raise BenchError(
                f"--max-gather-gib {gib} and --max-call-s {self.max_call_s}",
                "give a finite limit >= 0 GiB (or leave it unset) and seconds > 0",
            )
        if not 0 <= self.seed < 2**63:
            raise BenchError(f"--seed {self.seed}", "use a seed in 0 .. 2^63 - 1")
        check_prepare_options(self.prepare_options)
        if self.levels is not None and not 1 <= self.levels <= MAX_LEVELS:
            raise BenchError(
                f"--levels {self.levels} must be 1 to {MAX_LEVELS}",
                "use 3, or 0 for prepare's choice by catalogue size",
            )
        users = min(users_for(n, SyntheticConfig()) for n in self.sizes)
        if max(self.batch_sizes) > users:
            raise BenchError(
                f"batch size {max(self.batch_sizes)} is larger than the {users:,} users of "
                f"{min(self.sizes):,} synthetic items",
                f"pass --batch-sizes of at most {users:,}, or larger --sizes",
            )
        try:
            kind = torch.device(self.device).type
        except RuntimeError:  # a name torch does not know
            kind = None
        if kind not in ("cpu", "cuda") or (kind == "cuda" and not torch.cuda.is_available()):
            raise BenchError(
                f"--device {self.device}: not a device this machine has",
                "use cpu, or cuda on a machine with a CUDA GPU and torch",
            )


@dataclass(frozen=True)
class Cell:
    """One decoder at one width and batch size."""

    decoder: str
    beam_width: int | None  # None: the decoder has no beam
    batch: int
    latency_ms: float | None  # median per call; None: skipped
    users_per_s: float | None
    calls: int  # timed calls (1: the first two calls were over max_call_s)
    note: str = ""  # why skipped or not repeated


@dataclass(frozen=True)
class SizeReport:
    """Everything measured at one catalogue size."""

    items: int
    users: int
    levels: int  # code levels of an item (collision code included)
    prepare: PrepareCost
    trie_build_s: float
    trie_bytes_per_item: float
    model_bytes: int
    index_build_s: float | None  # None: no decoder read the index
    recall_at_k: float | None
    cells: list[Cell]


def trie_bytes(trie) -> int:
    """Bytes of every tensor of a `PrefixTrie`."""
    tensors = (trie.child_offsets, trie.child_codes, trie.edge_keys, trie.leaf_items)
    return sum(t.numel() * t.element_size() for t in tensors)


def random_model(data, item_table: str, seed: int, levels: str = "default"):
    """A random-weight `SemanticIdRecommender` of the default config on the catalogue (with
    levels="code-heads", its code levels as plain heads: `MODELS`); with item_table="embeddings"
    its item rows are the item embeddings through one seeded random projection, at the random
    rows' mean length (module docstring)."""
    from genrec_spec.data_pipelines.npy_rows import NpyRows, row_batches
    from genrec_spec.models.recsys.config import RecommenderConfig
    from genrec_spec.models.recsys.recommender import SemanticIdRecommender

    torch.manual_seed(seed)
    config = RecommenderConfig()
    if levels == "code-heads":
        heads = replace(config.item_objective, level0=False, tied_levels=None)
        config = replace(config, item_objective=heads)
    if data.long_ids is None:
        config = replace(config, long_id_heads=None)
    model = SemanticIdRecommender(
        config, data.item_codes, data.codebook_sizes, data.long_ids, data.long_id_sizes
    )
    if item_table == "embeddings":
        weight = model.embeddings.embeddings["t_item"].weight  # [I, D]
        # Read in row batches, not mapped: N x E floats need not fit, and a mapping's pages
        # would count as this process's memory (`NpyRows`).
        vectors = NpyRows(data.path / "item_embeddings.npy")  # [I, E]
        g = torch.Generator().manual_seed(seed)
        projection = torch.randn(vectors.shape[1], weight.shape[1], generator=g)  # [E, D]
        with torch.no_grad():
            scale = weight.norm(dim=1).mean()
            for start, batch in row_batches(vectors, 100_000):
                rows = torch.from_numpy(batch) @ projection
                weight[start : start + len(rows)] = torch.nn.functional.normalize(rows) * scale
    return model.eval()


def model_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


def gather_gib(model, batch: int, width: int, decoder: str) -> float:
    """GiB of item windows a tied level gathers at once for a beam of `width` on `batch` rows, at
    most (every beam reads the items under its prefix, here each the widest prefix's; spec_beam's
    drafts about triple the nodes)."""
    if model.config.tied_levels is None or decoder.startswith("dense"):
        return 0.0
    window = max(model.prefix_index().widths[:-1])  # most items under a scored prefix
    nodes = batch * width * (3 if decoder == "spec_beam" else 1)
    return nodes * window * model.config.dim * 4 / 2**30


def gather_limit_gib(settings: BenchScaleConfig) -> float:
    """The most GiB of item windows a cell may gather (`BenchScaleConfig.max_gather_gib`)."""
    if settings.max_gather_gib is not None:
        return settings.max_gather_gib
    device = torch.device(settings.device)
    if device.type != "cuda":
        return 4.0
    return torch.cuda.get_device_properties(device).total_memory / 4 / 2**30


def decoder_calls(names: tuple[str, ...], index_kind: str) -> dict[str, Callable]:
    """name -> call(model, values, offsets, k, trie, width); dense-index searches an index of
    `index_kind`."""
    from genrec_spec.recsys.decoders import beam, dense, spec_beam

    calls = {
        "beam": lambda m, v, o, k, t, w: beam.decode(m, v, o, k=k, trie=t, beam_width=w),
        "spec_beam": lambda m, v, o, k, t, w: spec_beam.decode(m, v, o, k=k, trie=t, beam_width=w),
        "dense": lambda m, v, o, k, t, w: dense.decode(m, v, o, k=k, trie=t, item_search="exact"),
        "dense-index": lambda m, v, o, k, t, w: dense.decode(
            m, v, o, k=k, trie=t, item_search="index", index_kind=index_kind
        ),
    }
    return {n: calls[n] for n in names}


def time_cells(model, histories, trie, settings: BenchScaleConfig, log) -> list[Cell]:
    """Every decoder at every width and batch size (module docstring)."""
    calls = decoder_calls(settings.decoders, settings.index_kind)
    cells = []
    for batch in settings.batch_sizes:
        for width in settings.beam_widths:
            names = [
                n for n in calls if not n.startswith("dense") or width == min(settings.beam_widths)
            ]
            seconds: dict[str, list[float]] = {n: [] for n in names}
            notes = dict.fromkeys(names, "")
            for name in names:
                gib = gather_gib(model, batch, width, name)
                if gib > gather_limit_gib(settings):
                    notes[name] = f"skipped: its tied levels would gather ~{gib:.0f} GiB"
                    continue
                part = histories.select(torch.arange(batch))
                for _ in range(2):  # a second try: the first builds what a decoder caches
                    took = _timed(calls[name], model, part, settings.k, trie, width)
                    if took <= settings.max_call_s:
                        break
                else:
                    seconds[name].append(took)
                    notes[name] = f"one call (the first two took over {settings.max_call_s:.0f} s)"
            for repeat in range(settings.repeats):
                rows = torch.arange(batch) + (repeat + 1) * batch
                part = histories.select(rows % len(histories))
                turn = repeat % len(names)
                for name in names[turn:] + names[:turn]:
                    if notes[name]:
                        continue
                    seconds[name].append(_timed(calls[name], model, part, settings.k, trie, width))
            for name in names:
                latency = statistics.median(seconds[name]) if seconds[name] else None
                cells.append(
                    Cell(
                        decoder=name,
                        beam_width=None if name.startswith("dense") else width,
                        batch=batch,
                        latency_ms=None if latency is None else latency * 1e3,
                        users_per_s=None if latency is None else batch / latency,
                        calls=len(seconds[name]),
                        note=notes[name],
                    )
                )
                log(f"  batch {batch} width {width} {name}: {_ms(cells[-1].latency_ms)} ms")
    return cells


def _timed(call, model, users, k: int, trie, width: int) -> float:
    """Wall seconds of one call, the device's queued work included (a GPU call returns before
    its kernels end)."""
    start = time.perf_counter()
    call(model, users.values, users.offsets, k, trie, width)
    finish(users.values.device)
    return time.perf_counter() - start


def bench_size(items: int, root: Path, settings: BenchScaleConfig, log) -> SizeReport:
    """Prepare (or reuse) one catalogue and measure it (module docstring)."""
    from genrec_spec.data_pipelines.trie import PrefixTrie
    from genrec_spec.recsys.data import load_prepared, sample_users
    from genrec_spec.recsys.decoders.dense import index_recall
    from genrec_spec.recsys.item_index import item_index

    cost = prepared_catalogue(items, root, settings.levels, log, settings.prepare_options)
    data = load_prepared(cost.folder)
    if max(settings.batch_sizes) > len(data.test):
        raise BenchError(
            f"batch size {max(settings.batch_sizes)} is larger than the {len(data.test):,} "
            f"test users of {items:,} items",
            f"pass --batch-sizes of at most {len(data.test):,} at this size",
        )
    builds = []
    for _ in range(3):  # built on the CPU, as prepare does
        start = time.perf_counter()
        trie = PrefixTrie.from_codes(data.item_codes, tuple(data.codebook_sizes))
        builds.append(time.perf_counter() - start)
    bytes_per_item = trie_bytes(trie) / items
    trie = trie.to(settings.device)
    model = random_model(data, settings.item_table, settings.seed, settings.model)
    model = model.to(settings.device)
    needed = max(settings.recall_users, (settings.repeats + 1) * max(settings.batch_sizes))
    users = sample_users(len(data.test), min(needed, len(data.test)), settings.seed)
    histories = data.test.select(users).to(settings.device)
    index_s = recall = None
    if "dense-index" in settings.decoders:
        start = time.perf_counter()
        item_index(model, ItemIndexConfig(kind=settings.index_kind))
        index_s = time.perf_counter() - start
        part = histories.select(torch.arange(min(settings.recall_users, len(histories))))
        found = index_recall(
            model, part.values, part.offsets, k=settings.k, index_kind=settings.index_kind
        )
        recall = float(found.mean())
        log(
            f"  item index ({settings.index_kind}) built in {index_s:.1f} s, "
            f"recall@{settings.k} {recall:.3f}"
        )
    cells = time_cells(model, histories, trie, settings, log)
    return SizeReport(
        items=items,
        users=len(data.test),
        levels=len(data.codebook_sizes),
        prepare=cost,
        trie_build_s=statistics.median(builds),
        trie_bytes_per_item=bytes_per_item,
        model_bytes=model_bytes(model),
        index_build_s=index_s,
        recall_at_k=recall,
        cells=cells,
    )


def bench_scale(
    settings: BenchScaleConfig,
    log: Callable[[str], None] = lambda line: None,
    # called after each size with the header and the sizes measured so far (a report written
    # there keeps them when a later size fails, e.g. one that does not fit memory)
    measured: Callable[[str, list[SizeReport]], None] = lambda header, reports: None,
) -> tuple[str, list[SizeReport]]:  # (a header line saying how it was measured, each size)
    """Every size of `settings` (module docstring); `bench.scale_report` formats them."""
    import faiss

    torch.set_num_threads(settings.threads)
    faiss.omp_set_num_threads(settings.threads)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="genrec-scale-") as temp:
        root = Path(settings.data_root or temp)
        check_writable_folder(root, "--data-root")
        reports = []
        for items in settings.sizes:
            log(f"synthetic:{items}")
            reports.append(bench_size(items, root, settings, log))
            header = (
                f"bench scale: {describe_device(settings.device)}, {settings.threads} "
                f"thread(s), K={settings.k}, median of {settings.repeats} calls per cell; a "
                f"random-weight model of the default config (code levels: {settings.model}; "
                f"item table: {settings.item_table}; dense-index: {settings.index_kind}), speed "
                f"only; {time.perf_counter() - started:.0f} s"
            )
            measured(header, reports)
    return header, reports


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"
