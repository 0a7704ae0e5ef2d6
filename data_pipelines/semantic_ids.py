"""Item embeddings -> Semantic IDs: short code tuples, unique per item.

Two quantisers share one result type (`SemanticIds`):

- "rq" (TIGER-style RQ-KMeans): `levels` rounds of faiss k-means with `codebook_size` codes, each
  clustering the residual the previous rounds left. Coarse-to-fine, so a prefix is a cluster of
  similar items. One collision level is ALWAYS appended (its size is the largest group of items
  sharing all quantiser codes, 1 if none do), so every RQ ID has `levels + 1` codes.
- "pq" (RPG-style long IDs): the vector (optionally rotated by OPQ) is cut into `pq_digits`
  equal chunks and each chunk gets its own k-means codebook; the digits are unordered and
  independent. Such IDs almost never collide, so the collision level is appended ONLY when some
  items share all digits (e.g. identical texts); `codes.shape[1]` says which happened.

The collision code numbers the items of a group 0, 1, 2, ... in item-index order, so the result
is deterministic and no two items share an ID.

Every k-means trains on a sample (at most `train_points_per_code` items a code: the rows faiss
itself would draw, `sampled_kmeans`) and then assigns every item, `batch_rows` at a time. So the
embeddings can be a matrix on disk larger than memory (`NpyRows`): a build reads it in two
sequential passes (the samples, then the assignment), and the codes equal those of the same
matrix in memory.

faiss runs on GPU when one is visible to it, else on CPU. A fixed seed gives identical codes on
the same machine and faiss thread count; another thread count (or GPU) may round distances
differently and move a few borderline items.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass

import faiss
import numpy as np
import torch

from genrec_spec.data_pipelines.errors import DataError
from genrec_spec.data_pipelines.npy_rows import row_batches
from genrec_spec.data_pipelines.sampled_kmeans import (
    assign,
    gather_rows,
    train_kmeans,
    training_rows,
)


@dataclass(frozen=True)
class SemanticIdConfig:
    kind: str = "rq"
    """"rq" (residual k-means, short hierarchical IDs) or "pq" (product k-means, long IDs)."""
    levels: int = 3
    """RQ only: residual k-means levels before the collision code."""
    codebook_size: int = 256
    """Codes per quantiser level (RQ level or PQ digit); at most the number of items."""
    pq_digits: int = 32
    """PQ only: number of digits; must divide the embedding dimension (384 -> 16 or 32)."""
    opq: bool = False
    """PQ only: learn an OPQ rotation first, spreading variance evenly over the chunks."""
    seed: int = 0
    """Seed of every k-means initialisation (level i uses seed + i); same seed, same codes."""
    niter: int = 25
    """Lloyd iterations per k-means."""
    train_points_per_code: int = 256
    """Each k-means trains on at most this many items per code (a seeded sample; faiss's own
    default), then assigns every item: catalogues up to 65,536 items at 256 codes train on all
    of them, larger ones on a sample, so the training cost stops growing with the catalogue."""
    use_gpu: bool | None = None
    """None: faiss GPU when faiss sees a GPU, else CPU. True/False force it."""
    batch_rows: int = 1 << 16
    """Rows read and assigned at a time: bounds the memory a build over a matrix on disk holds
    beside its samples and codes. The codes do not depend on it."""

    def __post_init__(self) -> None:
        if self.kind not in ("rq", "pq"):
            raise DataError(f"unknown semantic-ID kind {self.kind!r}", 'use kind "rq" or "pq"')
        counts = (
            self.levels,
            self.pq_digits,
            self.niter,
            self.train_points_per_code,
            self.batch_rows,
        )
        if min(counts) < 1 or self.codebook_size < 2:
            raise DataError(
                f"levels={self.levels}, pq_digits={self.pq_digits}, niter={self.niter}, "
                f"train_points_per_code={self.train_points_per_code}, "
                f"batch_rows={self.batch_rows}, codebook_size={self.codebook_size} are out of "
                "range",
                "use levels, pq_digits, niter, train_points_per_code, batch_rows >= 1 and "
                "codebook_size >= 2",
            )


@dataclass(frozen=True)
class SemanticIds:
    codes: torch.Tensor  # [I, L] int64; row i is item i's ID
    codebook_sizes: tuple[int, ...]
    """Codes per level, length L; the collision level (if any) is last."""
    has_collision_level: bool
    stats: dict
    """Plain JSON-ready values about the build:
    utilisation            per quantiser level, the fraction of its codes some item uses
    perplexity             per quantiser level, exp(entropy of code usage) (= size if uniform)
    unique_prefixes        distinct tuples of quantiser codes (before the collision code)
    collisions_before_code items - unique_prefixes: items that need the collision code
    max_items_per_prefix   most items sharing one tuple of quantiser codes (collision level size)
    quantization_mse       mean squared L2 distance from an embedding to its reconstruction
    seconds                wall time of the build
    backend                "faiss-gpu" or "faiss-cpu"
    """


def _read_as_rows(embeddings):  # [I, E] tensor, array or NpyRows -> the same, row-sliceable
    if isinstance(embeddings, torch.Tensor):
        return embeddings.detach().cpu().numpy()  # no copy for a CPU tensor
    return embeddings


def _train(x: np.ndarray, seed: int, config: SemanticIdConfig, gpu: bool) -> faiss.Kmeans:
    return train_kmeans(
        x, config.codebook_size, seed, config.niter, config.train_points_per_code, gpu
    )


def _sample(rows: int, seed: int, config: SemanticIdConfig) -> np.ndarray | None:  # [m] or None
    return training_rows(rows, config.codebook_size, config.train_points_per_code, seed)


def _train_residual(x, config: SemanticIdConfig, gpu: bool) -> list[faiss.Kmeans]:
    """RQ-KMeans codebooks, one per level, each trained on its sample's residual: the sample
    rows minus the centroids of the codes the earlier levels give them."""
    seeds = [config.seed + level for level in range(config.levels)]
    requests = [(_sample(len(x), seed, config), slice(None)) for seed in seeds]
    levels: list[faiss.Kmeans] = []
    for seed, residual in zip(seeds, gather_rows(x, requests, config.batch_rows), strict=True):
        for km in levels:
            residual -= km.centroids[assign(km, residual)]
        levels.append(_train(residual, seed, config, gpu))
    return levels


def _encode_rows(x, encode, width: int, config: SemanticIdConfig):
    """`encode` ([b, E] -> (codes [b, width] int64, squared reconstruction error [b])) run over
    every row of x [I, E], a batch at a time: (codes [I, width] int64, errors [I] float32)."""
    codes = np.empty((len(x), width), dtype=np.int64)
    errors = np.empty(len(x), dtype=np.float32)
    for start, block in row_batches(x, config.batch_rows):
        rows = slice(start, start + len(block))
        codes[rows], errors[rows] = encode(block)
    return codes, errors


def _encode_residual(levels: list[faiss.Kmeans], block: np.ndarray):
    # block [b, E] -> (RQ codes [b, levels], squared reconstruction error [b])
    residual = block.copy()
    codes = np.empty((len(block), len(levels)), dtype=np.int64)
    for level, km in enumerate(levels):
        codes[:, level] = code = assign(km, residual)
        residual -= km.centroids[code]
    recon = block - residual  # [b, E] the sum of the chosen centroids
    return codes, ((block - recon) ** 2).sum(1)


def _train_product(x, config: SemanticIdConfig, gpu: bool):
    """PQ codebooks, one per digit (each on its own sample's slice of the vector), after the
    OPQ rotation when asked for: (rotation or None, [digits] Kmeans)."""
    dim, digits = x.shape[1], config.pq_digits
    if dim % digits:
        raise DataError(
            f"pq_digits={digits} does not divide the embedding dimension {dim}",
            f"use --pq-digits among the divisors of {dim} (e.g. 16 or 32 for 384)",
        )
    rotation = _train_rotation(x, config) if config.opq else None
    width = dim // digits

    seeds = [config.seed + d for d in range(digits)]
    requests = [  # each digit's sample of the rotated rows, its slice of the columns
        (_sample(len(x), seed, config), slice(d * width, (d + 1) * width))
        for d, seed in enumerate(seeds)
    ]
    samples = gather_rows(x, requests, config.batch_rows, lambda rows: _rotate(rotation, rows))
    return rotation, [
        _train(part, seed, config, gpu) for part, seed in zip(samples, seeds, strict=True)
    ]


def _train_rotation(x, config: SemanticIdConfig):
    """An OPQ rotation, trained (as faiss's OPQMatrix.train does) on at most its
    `max_train_points` rows: the first of `rand_perm(n, 1234)`."""
    dim, digits = x.shape[1], config.pq_digits
    # OPQ's rotation is trained with its own PQ of 2**bits codes; few iterations suffice
    # for a catalogue of thousands (faiss's default takes minutes on CPU).
    bits = int(math.log2(config.codebook_size))
    opq_pq = faiss.ProductQuantizer(dim, digits, bits)  # kept alive: OPQ holds a raw pointer
    opq_pq.cp.min_points_per_centroid = 1
    opq_pq.cp.seed = config.seed
    rotation = faiss.OPQMatrix(dim, digits)
    rotation.niter = 8
    rotation.pq = opq_pq
    rows = training_rows(len(x), 1, rotation.max_train_points, 1234)
    (sample,) = gather_rows(x, [(rows, slice(None))], config.batch_rows)
    rotation.train(sample)
    rotation.referenced_objects = [opq_pq]  # alive as long as the rotation
    return rotation


def _rotate(rotation, rows: np.ndarray) -> np.ndarray:  # [b, E] -> [b, E]
    return rows if rotation is None else rotation.apply(np.ascontiguousarray(rows))


def _encode_product(rotation, digits: list[faiss.Kmeans], block: np.ndarray):
    # block [b, E] -> (PQ codes [b, digits], squared reconstruction error [b], measured against
    # the unrotated rows)
    width = block.shape[1] // len(digits)
    rotated = _rotate(rotation, block)
    codes = np.empty((len(block), len(digits)), dtype=np.int64)
    recon = np.empty_like(rotated)
    for d, km in enumerate(digits):
        cut = slice(d * width, (d + 1) * width)
        codes[:, d] = code = assign(km, rotated[:, cut])
        recon[:, cut] = km.centroids[code]
    if rotation is not None:
        recon = rotation.reverse_transform(recon)
    return codes, ((block - recon) ** 2).sum(1)


def _row_words(codes: np.ndarray) -> list[np.ndarray]:  # [I, L] ints -> W x [I] uint64
    """Rows packed into as few 64-bit words as their columns' bit widths allow, the first
    column in the most significant bits: equal rows give equal words, and the words compare as
    the rows do (lexicographically)."""
    words, word, used = [], np.zeros(len(codes), dtype=np.uint64), 0
    for column in codes.T:
        low = column.min() if len(column) else 0
        value = (column - low).astype(np.uint64)
        bits = max(1, int(value.max()).bit_length()) if len(value) else 1
        if used + bits > 64:
            words.append(word)
            word, used = np.zeros(len(codes), dtype=np.uint64), 0
        word = (word << np.uint64(bits)) | value
        used += bits
    return [*words, word]


def _sorted_rows(codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """codes [I, L] -> (order [I]: items sorted by their codes, item-index order among equal
    rows; first [I] bool: sorted position i starts a new distinct row)."""
    words = _row_words(codes)
    order = np.argsort(words[0], kind="stable")
    head = words[0][order]
    tie = head[1:] == head[:-1]  # [I - 1] equal first words: the other words decide
    if len(words) > 1 and tie.any():
        tied = np.zeros(len(order), dtype=bool)
        tied[1:] |= tie
        tied[:-1] |= tie
        at = np.flatnonzero(tied)  # runs of equal first words, each contiguous
        run = np.cumsum(np.concatenate([[True], ~tie])[at])
        items = order[at]
        keys = [w[items] for w in reversed(words[1:])] + [run]  # lexsort: last key first
        order[at] = items[np.lexsort(keys)]  # stable: item order within equal rows
    first = np.ones(len(order), dtype=bool)
    first[1:] = False
    for w in words:
        ranked = w[order]
        first[1:] |= ranked[1:] != ranked[:-1]
    return order, first


def collision_codes(codes: np.ndarray) -> np.ndarray:
    """codes [I, L] -> [I] int64: rank of each item among the items with the same codes, in
    item-index order (0 for the first, 1 for the next...)."""
    codes = np.asarray(codes)
    order, first = _sorted_rows(codes)
    position = np.arange(len(codes))
    group_start = np.maximum.accumulate(np.where(first, position, 0))  # [I] sorted positions
    rank = np.empty(len(codes), dtype=np.int64)
    rank[order] = position - group_start
    return rank


def count_unique_rows(codes: np.ndarray) -> int:  # codes: [I, L] ints
    """How many distinct rows `codes` has."""
    return int(_sorted_rows(np.asarray(codes))[1].sum()) if len(codes) else 0


def _usage(codes: np.ndarray, size: int) -> tuple[float, float]:
    """codes [I] -> (fraction of the `size` codes used, perplexity of their usage)."""
    p = np.bincount(codes, minlength=size) / len(codes)
    p_used = p[p > 0]
    return float(len(p_used) / size), float(np.exp(-(p_used * np.log(p_used)).sum()))


def build_semantic_ids(embeddings, config: SemanticIdConfig) -> SemanticIds:
    # embeddings: [I, E] float: a tensor, an array, or `NpyRows` (a matrix on disk)
    """Quantise item embeddings into unique Semantic IDs (see the module docstring), reading
    them `config.batch_rows` rows at a time."""
    start = time.perf_counter()
    x = _read_as_rows(embeddings)
    if len(x.shape) != 2 or len(x) == 0:
        raise DataError(
            f"item embeddings must be a non-empty [items, dim] matrix, got shape {tuple(x.shape)}",
            "pass one embedding row per item",
        )
    n = len(x)
    if config.codebook_size > n:
        raise DataError(
            f"codebook size {config.codebook_size} is larger than the {n} items "
            "(k-means needs at least one item per code)",
            f"use --codebook-size <= {n}",
        )
    gpu = faiss.get_num_gpus() > 0 if config.use_gpu is None else config.use_gpu
    if gpu and faiss.get_num_gpus() == 0:
        raise DataError("use_gpu=True but faiss sees no GPU", "install faiss-gpu or use_gpu=None")

    if config.kind == "rq":
        encode = functools.partial(_encode_residual, _train_residual(x, config, gpu))
        width = config.levels
    else:
        encode = functools.partial(_encode_product, *_train_product(x, config, gpu))
        width = config.pq_digits
    codes, errors = _encode_rows(x, encode, width, config)
    collision = collision_codes(codes)
    max_group = int(collision.max()) + 1
    usage = [_usage(codes[:, level], config.codebook_size) for level in range(codes.shape[1])]
    sizes = (config.codebook_size,) * codes.shape[1]
    # The collision code ranks the items of each group of equal codes: with it (or with no
    # group of two) every item's ID is its own.
    has_collision_level = config.kind == "rq" or max_group > 1
    if has_collision_level:
        codes = np.concatenate([codes, collision[:, None]], axis=1)
        sizes += (max_group,)
    collisions = int((collision > 0).sum())
    stats = {
        "utilisation": [u for u, _ in usage],
        "perplexity": [p for _, p in usage],
        "unique_prefixes": n - collisions,
        "collisions_before_code": collisions,
        "max_items_per_prefix": max_group,
        "quantization_mse": float(errors.mean()),
        "seconds": time.perf_counter() - start,
        "backend": "faiss-gpu" if gpu else "faiss-cpu",
    }
    return SemanticIds(torch.from_numpy(codes), sizes, has_collision_level, stats)
