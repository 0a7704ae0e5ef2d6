"""Approximate top-K items by the item objective: a faiss inner-product index over the model's
item table, so that a request does not multiply its user states by the whole catalogue.

    found = top_items(model, state.hidden, k)      # the index's (or the exact product's) top-K
    recall_at_k(found.items, exact_top_items(model, state.hidden, k).items)  # [B]

The model's item logit is q(h) . e_i (`CodeLevels.item_scores`): q the history state h, and e_i
the item's row of the tied output table; with a cosine temperature both at unit length and q
divided by the temperature. The index holds the e_i exactly as the model scores them and is
searched with q(h), so its inner-product order is the model's logit order, and the score of an
item it finds is that item's logit. It cannot give log-probabilities: the softmax normaliser
sums over every item, which is what the index avoids.

Kinds (`ItemIndexConfig.kind`): "ivf" (`IndexIVFFlat`: spherical k-means lists, `nprobe` of them
scanned exactly per query), "ivf-pq" (the same lists holding 4-bit codes, one per dimension,
scanned with faiss's SIMD fast scan, `IndexIVFPQFastScan`; the `refine_factor` x K best codes
are then rescored exactly from the items' own rows, `IndexRefineFlat`, so the scores and their
order are exact, and only an item the codes rank below that cut can be lost), "ivf-hnsw" (the
same codes in lists of about `list_items` items whatever the catalogue's size, found through an
HNSW graph over the lists' centroids, which a two-level k-means trains: the items a query
scans need not grow with the catalogue, where the other IVF kinds' lists grow with sqrt(I))
and "hnsw" (`IndexHNSWFlat`, a proximity graph over the items themselves). "ivf-pq" is the
default: its lists are IVF's, so it finds what they hold, and it scans them several times
faster, for a slower build and the codes beside the rows in memory. IVF's cost per query is set
by one knob (the items in the probed lists) and does not grow with K, which the "items" draft
asks large (hundreds of items at wide beams: HNSW must then widen its candidate list to at least
K), and with plain dot-product logits (no temperature) its probed lists are scanned exactly,
where HNSW's graph assumes a metric; HNSW at the settings measured also built far slower than
IVF and found less. A catalogue of fewer than `PQ_CODES` items gets "ivf" lists (too few to
train a 4-bit code on). `genrec-spec bench scale --index-kind` measures each kind
(docs/results/scale.md).

The index is built once per item table (and config) and again when the table changes, like the
catalogue trie (`recsys.item_trie`). `use_index` decides, per decode, between the index and the
exact product: "auto" uses the index from `ItemIndexConfig.min_items` items on.

Shape letters: B users, D model width, I items, K results.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from genrec_spec.models.derived import DerivedCache
from genrec_spec.recsys.errors import DecodeOptionError

KINDS = ("ivf", "ivf-pq", "ivf-hnsw", "hnsw")
# Items added to an index per faiss call: its temporaries (codes, residuals) scale with the rows
# of one call, which at 10^7 items at once ran the bench process out of memory.
ADD_ROWS = 1 << 20
# ivf-hnsw: the candidates its graph keeps while finding an added item's list (its nearest
# centroid). A narrow search finds the exact nearest list nearly always, at a fraction of a
# query's width's cost, which adding 10^7 items pays 10^7 times (docs/results/scale.md).
ADD_EF_SEARCH = 32
# Values of a 4-bit code: ivf-pq trains each on the items, so it needs at least this many.
PQ_CODES = 16
# Item logits exact_top_items holds at once (float32: 1 GiB).
EXACT_LOGITS = 1 << 28
SEARCHES = ("auto", "exact", "index")  # the decoders' `item_search` option


@dataclass(frozen=True)
class ItemIndexConfig:
    """The approximate item index, and from which catalogue size decoders search it."""

    # "auto" searches the index from this many items on, the exact [B, I] product below
    min_items: int = 100_000
    kind: str = "ivf-pq"  # one of KINDS (module docstring)
    lists_per_sqrt_item: float = 1.0  # ivf, ivf-pq: k-means lists = this x sqrt(I)
    list_items: int = 1000  # ivf-hnsw: items a list (I / this lists, whatever the size)
    train_items_per_list: int = 64  # ivf kinds: k-means trains on this many items a list
    nprobe: int = 128  # ivf kinds: lists scanned per query (every list of a small catalogue)
    # ivf, ivf-pq: scan at least this share of the lists. Their recall follows the share of the
    # catalogue scanned, not the items scanned, so a fixed nprobe loses recall as the catalogue
    # grows (docs/results/scale.md, "the probes it needs").
    min_probe_share: float = 0.06
    refine_factor: int = 30  # ivf-pq, ivf-hnsw: codes' best refine_factor x K rescored exactly
    hnsw_links: int = 32  # hnsw, ivf-hnsw: graph links per item or list (faiss's M)
    ef_construction: int = 64  # hnsw, ivf-hnsw: candidates kept while building the graph
    ef_search: int = 128  # hnsw, ivf-hnsw: candidates a query keeps (at least K, nprobe)
    seed: int = 0  # ivf: the k-means seed

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise DecodeOptionError(
                f"item index kind {self.kind!r} is not one of {KINDS}",
                f"use one of {KINDS}",
            )
        counts = (
            "min_items",
            "nprobe",
            "refine_factor",
            "train_items_per_list",
            "hnsw_links",
            "ef_construction",
            "list_items",
        )
        small = [
            f"{n} = {getattr(self, n)}" for n in (*counts, "ef_search") if getattr(self, n) < 1
        ]
        if small:
            raise DecodeOptionError(
                f"item index {', '.join(small)} must be >= 1", "use counts >= 1"
            )
        if not 0.0 <= self.min_probe_share <= 1.0:
            raise DecodeOptionError(
                f"min_probe_share must be in [0, 1], got {self.min_probe_share}",
                "give the least share of the lists a query scans, e.g. 0.06",
            )
        if self.lists_per_sqrt_item <= 0:
            raise DecodeOptionError(
                f"lists_per_sqrt_item must be > 0, got {self.lists_per_sqrt_item}",
                "use a positive factor (lists = factor x sqrt(items))",
            )


@dataclass(frozen=True)
class FoundItems:
    """Top-K items of each row, best first."""

    items: Tensor  # [B, K] int64; -1 where the index found fewer than K
    scores: Tensor  # [B, K] their item logits; -inf where items is -1


class ItemIndex:
    """A faiss inner-product index over one item table (rows in item order)."""

    def __init__(self, table: Tensor, config: ItemIndexConfig) -> None:  # table: [I, D]
        import faiss  # a declared dependency, imported only where an index is built

        x = np.ascontiguousarray(table.detach().float().cpu().numpy())
        items, dim = x.shape
        self.config = config
        self.items = items
        if config.kind == "hnsw":
            self.index = faiss.IndexHNSWFlat(dim, config.hnsw_links, faiss.METRIC_INNER_PRODUCT)
            self.index.hnsw.efConstruction = config.ef_construction
        else:
            ip = faiss.METRIC_INNER_PRODUCT
            # faiss's Python constructors keep the indexes they wrap alive (the quantizer here,
            # the IVF index in the refining one)
            if config.kind == "ivf-hnsw":  # the lists' centroids first: they fix their number
                centroids = _two_level_centroids(x, max(1, items // config.list_items), config)
                lists = len(centroids)
                quantizer = faiss.IndexHNSWFlat(dim, config.hnsw_links, ip)
                quantizer.hnsw.efConstruction = config.ef_construction
                quantizer.add(centroids)
                quantizer.hnsw.efSearch = ADD_EF_SEARCH  # each item's list, as it is added
            else:
                lists = max(1, min(items, round(config.lists_per_sqrt_item * math.sqrt(items))))
                quantizer = faiss.IndexFlatIP(dim)
            codes = config.kind != "ivf" and items >= PQ_CODES
            if codes:  # one 4-bit code per dimension
                ivf = faiss.IndexIVFPQFastScan(quantizer, dim, lists, dim, 4, ip)
            else:
                ivf = faiss.IndexIVFFlat(quantizer, dim, lists, ip)
            ivf.cp.seed = config.seed
            ivf.cp.min_points_per_centroid = 1  # small catalogues: few items a list
            ivf.cp.max_points_per_centroid = config.train_items_per_list
            # k-means lists (on a seeded sample of train_items_per_list items a list) unless the
            # quantizer holds them already, then the 4-bit codes
            ivf.train(x)
            share = config.min_probe_share if config.kind != "ivf-hnsw" else 0.0
            ivf.nprobe = min(max(config.nprobe, math.ceil(share * lists)), lists)
            self.index = ivf
            if codes:
                self.index = faiss.IndexRefineFlat(ivf)
                self.index.k_factor = config.refine_factor
        for start in range(0, items, ADD_ROWS):
            self.index.add(x[start : start + ADD_ROWS])
        if config.kind == "ivf-hnsw":  # a query's nprobe nearest lists
            quantizer.hnsw.efSearch = max(config.ef_search, config.nprobe)

    def search(self, query: Tensor, k: int) -> FoundItems:  # query: [B, D] -> [B, K]
        if self.config.kind == "hnsw":
            self.index.hnsw.efSearch = max(self.config.ef_search, k)
        q = np.ascontiguousarray(query.detach().float().cpu().numpy())
        scores, items = self.index.search(q, min(k, self.items))
        items = torch.from_numpy(items).to(query.device)
        scores = torch.from_numpy(scores).to(query.device, query.dtype)
        return FoundItems(items=items, scores=scores.masked_fill(items < 0, float("-inf")))


def _two_level_centroids(x: np.ndarray, lists: int, config: ItemIndexConfig) -> np.ndarray:
    """About `lists` spherical k-means centroids [L, D] of the rows x [I, D], by k-means in two
    levels (as faiss's `contrib.clustering.two_level_clustering`): sqrt(lists) coarse clusters,
    each then split into lists in proportion to its items. A flat k-means costs samples x lists
    a step, hours on one core for 10^5 lists of 10^7 items; the two levels about sqrt(lists)
    times less. Both train on a seeded sample of `train_items_per_list` items a list. Not the
    contrib function itself: its split can give a small cluster no list, or more lists than
    rows, and faiss's k-means refuses both (k = 0, or fewer points than centroids)."""
    import faiss

    rng = np.random.default_rng(config.seed)
    sample = min(len(x), lists * config.train_items_per_list)
    xt = x[np.sort(rng.choice(len(x), sample, replace=False))] if sample < len(x) else x
    coarse = max(1, round(math.sqrt(lists)))
    top = faiss.Kmeans(x.shape[1], coarse, spherical=True, seed=config.seed)
    top.train(xt)
    assigned = top.index.search(xt, 1)[1][:, 0]  # [sample] each row's coarse cluster
    sizes = np.bincount(assigned, minlength=coarse)
    # each coarse cluster's lists: its share of the sample, at least one, at most its rows
    shares = np.clip(np.round(sizes * lists / len(xt)), 1, np.maximum(sizes, 1)).astype(int)
    centroids = []
    for cluster, share in enumerate(shares.tolist()):
        rows = np.ascontiguousarray(xt[assigned == cluster])
        if share >= len(rows):  # as many lists as rows: the rows (an empty cluster: its centre)
            centroids.append(rows if len(rows) else top.centroids[cluster : cluster + 1])
            continue
        split = faiss.Kmeans(x.shape[1], share, spherical=True, seed=config.seed)
        split.cp.min_points_per_centroid = 1
        split.train(rows)
        centroids.append(split.centroids)
    return np.ascontiguousarray(np.concatenate(centroids), dtype=np.float32)


_INDEXES = DerivedCache()  # item table (as the model scores with it) -> its ItemIndex


def item_index(model, config: ItemIndexConfig = ItemIndexConfig()) -> ItemIndex:
    """The model's item index, built once per item table and config, again when the table is
    rewritten in place (an optimiser step, `load_state_dict`) or replaced."""
    with torch.no_grad():  # with a temperature: the unit rows the model caches per weight version
        table = model.item_keys()  # [I, D] the rows its logits read
    return _INDEXES.get(table, (table,), lambda: ItemIndex(table, config), extra=config)


def use_index(model, item_search: str, config: ItemIndexConfig = ItemIndexConfig()) -> bool:
    """Whether a decode searches the index ("index"; "auto" from config.min_items items on) or
    takes the exact product ("exact"); raises on another value."""
    if item_search not in SEARCHES:
        raise DecodeOptionError(
            f"item_search must be one of {SEARCHES}, got {item_search!r}",
            '"auto" (the index for large catalogues), "exact" or "index"',
        )
    return item_search == "index" or (item_search == "auto" and model.num_items >= config.min_items)


def top_items(
    model,  # SemanticIdRecommender with the item objective
    hidden: Tensor,  # [B, D] history states
    k: int,
    config: ItemIndexConfig = ItemIndexConfig(),
) -> FoundItems:  # [B, K] the index's top-K by item logit
    return item_index(model, config).search(model.item_query(hidden), k)


def exact_top_items(model, hidden: Tensor, k: int) -> FoundItems:  # hidden: [B, D] -> [B, K]
    """The exact top-K by item logit: the whole [B, I] product, a few rows at a time so that the
    logits held at once stay under `EXACT_LOGITS` (256 rows at 10^7 items would be 10 GB)."""
    rows = max(1, EXACT_LOGITS // model.num_items)
    tops = [
        model.item_scores(part).topk(min(k, model.num_items), dim=1) for part in hidden.split(rows)
    ]
    return FoundItems(
        items=torch.cat([t.indices for t in tops]), scores=torch.cat([t.values for t in tops])
    )


def recall_at_k(
    found: Tensor,  # [B, K] int64 items an approximate search returned (-1: none)
    exact: Tensor,  # [B, K] int64 the exact top-K
) -> Tensor:  # [B] the share of each row's exact top-K that was found
    hit = (exact[:, :, None] == found[:, None, :]).any(dim=2)  # [B, K]
    return hit.float().mean(dim=1)
