"""RPG-style decoding: long product-quantised IDs predicted in parallel, decoded over an item graph.

Every item has a long ID of Q digits (the data pipeline's PQ codes, e.g. 32 digits of 256
values). `LongIdHeads` predicts all Q digits independently from the last history state h in one
backbone pass, and an item's score is the sum of its digits' log-probabilities. Two modes, and
``auto`` (the default), which walks the graph only from ``RpgConfig.graph_min_items`` items on:

- ``exact``: score every catalogue item and take the top K.
- ``graph`` (RPG's graph-constrained decoding): score only the items a beam walk over a k-NN
  graph of the items reaches. The beam starts as the best W of S fixed seed items; each step
  scores the G graph neighbours of the beam's items and keeps the best W of beam + neighbours
  (so the beam only improves); the walk stops after `steps` steps or when no row's beam changed.
  The top K of the last beam is the answer. Cost per user: S + steps * W * G item scores instead
  of I, which pays only when the catalogue is much larger than that: below ~10^5 items one
  [D, I] product and a top-K cost less than the walk's gathers and per-step sorts, and find
  every item the walk misses (docs/results/recsys-speed.md, "rpg: exact below 10^5 items").

The graph. With u = proj(h) the heads' shared projection, W_q / b_q the output rows / biases of
digit q and d_q(i) item i's digit q, an item's score is an inner product plus a constant:

    score(i) = <u, e_i> + c_i - sum_q logsumexp_q(u),   e_i = sum_q W_q[d_q(i)],
                                                      c_i = sum_q b_q[d_q(i)]

so items with similar e_i score alike for every user, and scoring every item is one [B, D] x
[D, I] product (`ItemTable`, cached per model) instead of Q gathers of [B, I], several times
faster, equal to the summed digit log-probs up to float rounding. The walk scores
its candidates the same way. The graph links each item to its G nearest
items by cosine similarity of e_i (faiss: exact `IndexFlatIP` up to `flat_limit` items, HNSW
beyond), and the seeds are the items nearest to S k-means centroids of the same vectors: a fixed,
diverse start set. Table, graph and seeds are built once per model, from its weights at first
use, and cached (rebuilt when the weights change in place or the graph options differ).

Shape letters: B users, M history items, I items, Q long-ID digits, V digit values, W beam,
G neighbours per item, S seeds, C candidates, K recommendations, D model width.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from genrec_spec.data_pipelines.trie import PrefixTrie
from genrec_spec.models.derived import DerivedCache
from genrec_spec.models.recsys.times import HistoryTimes
from genrec_spec.recsys.decoders.heads import check_decode_args
from genrec_spec.recsys.errors import DecodeOptionError
from genrec_spec.recsys.inference import inference
from genrec_spec.recsys.types import Recommendations, RecommendStats

MODES = ("auto", "graph", "exact")


@dataclass(frozen=True)
class RpgConfig:
    """Options of the `rpg` decoder (graph walk and graph construction)."""

    mode: str = "auto"  # "graph": walk the item graph; "exact": score every item; "auto": ...
    # ... walk from this many items on (below it exact mode is faster: module docstring)
    graph_min_items: int = 100_000
    beam: int = 32  # W, items kept per step (raised to K when K is larger)
    steps: int = 4  # most expansion steps of the walk
    degree: int = 16  # G, neighbours per item in the k-NN graph
    seeds: int = 128  # S, fixed seed items the walk starts from (W > S: the beam fills up)
    flat_limit: int = 50_000  # exact k-NN graph up to this many items, faiss HNSW beyond
    seed: int = 0  # k-means seed of the seed items


@dataclass(frozen=True)
class ItemGraph:
    """The k-NN graph of a model's items and the walk's seed items."""

    neighbours: Tensor  # [I, G] int64 most similar items first (not the item itself)
    seeds: Tensor  # [S] int64 distinct items
    build_s: float  # seconds it took to build


@dataclass(frozen=True)
class ItemTable:
    """Every item's score as an inner product (module docstring): score(i) = <u, vectors[i]> +
    biases[i] - sum_q logsumexp_q(u), u = proj(h)."""

    vectors: Tensor  # [I, D] e_i: the item's summed digit rows of the output layer
    biases: Tensor  # [I] c_i: the item's summed digit biases


def item_table(model) -> ItemTable:
    return ItemTable(*model.long_id_heads.item_table(model.long_ids))


def build_item_graph(model, config: RpgConfig) -> ItemGraph:
    """k-NN graph (cosine of the items' summed digit embeddings) and k-means seed items."""
    import faiss

    start = time.perf_counter()
    vectors = item_table(model).vectors
    x = torch.nn.functional.normalize(vectors.detach().float(), dim=1).cpu().numpy()
    x = np.ascontiguousarray(x, dtype=np.float32)
    items, dim = x.shape
    degree = max(1, min(config.degree, items - 1))
    flat = faiss.IndexFlatIP(dim)
    flat.add(x)
    index = flat
    if items > config.flat_limit:
        index = faiss.IndexHNSWFlat(dim, 32, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efSearch = max(64, 2 * degree)
        index.add(x)
    _, found = index.search(x, degree + 1)  # [I, G+1], usually the item itself first
    found = torch.from_numpy(found).long()
    self_or_missing = (found == torch.arange(items)[:, None]) | (found < 0)
    # A stable sort moves the item itself and HNSW's missing (-1) slots last, keeping the order.
    order = torch.sort(self_or_missing.long(), dim=1, stable=True).indices
    neighbours = found.gather(1, order)[:, :degree]
    # A one-item catalogue (or a short HNSW list) leaves the item itself: a harmless repeat.
    neighbours = torch.where(neighbours >= 0, neighbours, torch.arange(items)[:, None])

    kmeans = faiss.Kmeans(dim, min(config.seeds, items), niter=20, seed=config.seed)
    kmeans.cp.min_points_per_centroid = 1  # small catalogues: few items per seed is the point
    kmeans.train(x)
    _, nearest = flat.search(kmeans.centroids, 1)  # [S, 1] the item nearest each centroid
    seeds = torch.from_numpy(nearest[:, 0]).long().unique()
    device = model.long_ids.device
    return ItemGraph(neighbours.to(device), seeds.to(device), time.perf_counter() - start)


class WeightCache:
    """One value per model, `build(model, options)`, rebuilt when the long-ID heads' output layer
    changes in place (optimiser steps and load_state_dict bump its versions) or `key(options)`
    differs; weakly keyed by the heads module, so it goes when the model goes (and a model seen
    through a `history_cache.CachedRecommender` shares its value)."""

    def __init__(self, build, key=lambda options: options) -> None:
        self._build, self._key = build, key
        self._values = DerivedCache()

    def get(self, model, options=None):
        heads = model.long_id_heads
        return self._values.get(
            heads,
            (heads.out.weight, heads.out.bias),
            lambda: self._build(model, options),
            self._key(options),
        )


GRAPHS = WeightCache(build_item_graph, key=lambda c: (c.degree, c.seeds, c.seed, c.flat_limit))
TABLES = WeightCache(lambda model, _: item_table(model))


def digit_normalizer(model, u: Tensor) -> Tensor:  # u: [B, D] -> [B] sum_q logsumexp_q(u)
    """The log-partition of the digit heads, summed over digits (each over its own values)."""
    heads = model.long_id_heads
    logits = heads.out(u).unflatten(-1, (len(heads.digit_sizes), heads.vmax))  # [B, Q, V]
    if min(heads.digit_sizes) < heads.vmax:  # e.g. a last digit of 2 values
        sizes = torch.tensor(heads.digit_sizes, device=u.device)
        real = torch.arange(heads.vmax, device=u.device) < sizes[:, None]  # [Q, V]
        logits = logits.masked_fill(~real, float("-inf"))
    return logits.logsumexp(dim=-1).sum(dim=-1)


def candidate_scores(
    u: Tensor,  # [B, D] the heads' projection of the history state
    norm: Tensor,  # [B] digit_normalizer(model, u)
    table: ItemTable,
    candidates: Tensor,  # [B, C] int64 items to score; -1 = none
) -> Tensor:  # [B, C] sum of each candidate's digit log-probs; -inf for -1
    safe = candidates.clamp(min=0)
    dot = torch.bmm(table.vectors[safe], u[:, :, None]).squeeze(2)  # [B, C]
    total = dot + table.biases[safe] - norm[:, None]
    return total.masked_fill(candidates < 0, float("-inf"))


def best_unique(
    items: Tensor,  # [B, C] int64 items, -1 = none (a repeated item has the same score)
    scores: Tensor,  # [B, C]; -inf for -1
    width: int,  # W <= C
) -> tuple[Tensor, Tensor]:  # (items [B, W], scores [B, W]) distinct, best first; -1 = none
    ordered, order = items.sort(dim=1)
    ordered_scores = scores.gather(1, order)
    repeat = torch.zeros_like(ordered, dtype=torch.bool)
    repeat[:, 1:] = ordered[:, 1:] == ordered[:, :-1]
    top = ordered_scores.masked_fill(repeat, float("-inf")).topk(width, dim=1)
    found = ordered.gather(1, top.indices)
    return torch.where(top.values > float("-inf"), found, -1), top.values


def graph_walk(
    score,  # candidates [B, C] int64 (-1 = none) -> their scores [B, C] (-inf for -1)
    batch: int,
    graph: ItemGraph,
    width: int,  # W
    steps: int,
) -> tuple[Tensor, Tensor, dict]:  # (items [B, W], scores [B, W], RecommendStats fields); -1 = none
    """The beam walk of the module docstring. While fewer than W items are known (W above the
    seed count) the beam holds -1 entries, which expand to nothing."""
    seeds = graph.seeds.expand(batch, -1)  # [B, S]
    seeds = torch.nn.functional.pad(seeds, (0, max(0, width - seeds.shape[1])), value=-1)
    seed_scores = score(seeds)
    beam, beam_scores = best_unique(seeds, seed_scores, width)
    scored, taken = len(graph.seeds), 0
    for _ in range(steps):
        neighbours = graph.neighbours[beam.clamp(min=0)]  # [B, W, G]
        neighbours = torch.where(beam[..., None] >= 0, neighbours, -1).flatten(1)  # [B, W*G]
        new, new_scores = best_unique(
            torch.cat([beam, neighbours], dim=1),
            torch.cat([beam_scores, score(neighbours)], dim=1),
            width,
        )
        scored, taken = scored + neighbours.shape[1], taken + 1
        changed = bool((new.sort(dim=1).values != beam.sort(dim=1).values).any())
        beam, beam_scores = new, new_scores
        if not changed:  # every row's beam is a fixed point (one host sync per step)
            break
    return beam, beam_scores, {"graph_steps": taken, "items_scored_per_user": scored}


@inference
def decode(
    model,  # SemanticIdRecommender with long-ID heads
    values: Tensor,  # [M] int64 item indices of B histories, oldest first
    offsets: Tensor,  # [B+1] int64
    *,
    k: int,
    trie: PrefixTrie,
    mode: str = RpgConfig.mode,
    beam: int = RpgConfig.beam,
    steps: int = RpgConfig.steps,
    degree: int = RpgConfig.degree,
    seeds: int = RpgConfig.seeds,
    times: HistoryTimes | None = None,  # a time-aware model's (`models.recsys.times`)
) -> Recommendations:
    """Top-K items by the long-ID heads' summed digit log-probs, over the item graph or exactly."""
    check_decode_args(model, k, trie)
    if model.long_id_heads is None:
        raise DecodeOptionError(
            "the rpg decoder needs long-ID heads",
            "prepare the data with --long-id-digits > 0 and train with model.long_id_heads = "
            'true, or use decoder "beam"',
        )
    if mode not in MODES:
        raise DecodeOptionError(
            f"rpg mode must be one of {MODES}, got {mode!r}",
            'pass mode="auto", "graph" or "exact"',
        )
    if min(beam, steps, degree, seeds) < 1:
        raise DecodeOptionError(
            f"rpg beam, steps, degree and seeds must all be >= 1, got {beam}, {steps}, "
            f"{degree}, {seeds}",
            "pass positive counts or leave them unset",
        )
    if mode == "auto":
        mode = "graph" if model.num_items >= RpgConfig.graph_min_items else "exact"
    config = RpgConfig(mode=mode, beam=beam, steps=steps, degree=degree, seeds=seeds)
    counted: dict = {}  # this mode's own RecommendStats fields
    table = TABLES.get(model)  # built before the clock starts, like the graph: one-off costs
    if mode == "graph":
        graph = GRAPHS.get(model, config)
        counted["graph_build_s"] = graph.build_s
    start = time.perf_counter()
    state = model.encode_history(values, offsets, times)
    u = model.long_id_heads.proj(state.hidden)  # [B, D]
    norm = digit_normalizer(model, u)  # [B]
    if mode == "exact":
        every = torch.addmm(table.biases, u, table.vectors.T) - norm[:, None]  # [B, I]
        top = every.topk(k, dim=1)
        items, scores = top.indices, top.values
        counted["items_scored_per_user"] = model.num_items
    else:
        width = min(max(beam, k), model.num_items)
        found, found_scores, walk = graph_walk(
            lambda items: candidate_scores(u, norm, table, items), len(u), graph, width, steps
        )
        items, scores = found[:, :k], found_scores[:, :k]  # W >= k
        counted |= walk
    stats = RecommendStats(
        target_passes=1,
        nodes_scored=0,
        wall_time_s=time.perf_counter() - start,
        truncated_histories=int(state.truncated.sum()),
        **counted,
    )
    return Recommendations(items=items, scores=scores, stats=stats)
