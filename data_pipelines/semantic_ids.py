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
is deterministic and no two items share an ID (checked before returning).

faiss runs on GPU when one is visible to it, else on CPU. A fixed seed gives identical codes on
the same machine and faiss thread count; another thread count (or GPU) may round distances
differently and move a few borderline items.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import faiss
import numpy as np
import torch

from genrec_spec.data_pipelines.errors import DataError


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

    def __post_init__(self) -> None:
        if self.kind not in ("rq", "pq"):
            raise DataError(f"unknown semantic-ID kind {self.kind!r}", 'use kind "rq" or "pq"')
        counts = (self.levels, self.pq_digits, self.niter, self.train_points_per_code)
        if min(counts) < 1 or self.codebook_size < 2:
            raise DataError(
                f"levels={self.levels}, pq_digits={self.pq_digits}, niter={self.niter}, "
                f"train_points_per_code={self.train_points_per_code}, "
                f"codebook_size={self.codebook_size} are out of range",
                "use levels, pq_digits, niter, train_points_per_code >= 1 and codebook_size >= 2",
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


def _kmeans(x: np.ndarray, k: int, seed: int, config: SemanticIdConfig, gpu: bool):
    """Train k-means on x [n, d]; return (centroids [k, d], assignment [n] int64)."""
    km = faiss.Kmeans(
        x.shape[1],
        k,
        niter=config.niter,
        seed=seed,
        gpu=gpu,
        # Item catalogues are small (n / k is ~5-15): faiss's default minimum of 39 points per
        # centroid only prints warnings here.
        min_points_per_centroid=1,
        max_points_per_centroid=config.train_points_per_code,
    )
    km.train(x)
    _, assignment = km.assign(x)
    return km.centroids, assignment.astype(np.int64)


def _residual_codes(x: np.ndarray, config: SemanticIdConfig, gpu: bool):
    """RQ-KMeans on x [I, E]: (codes [I, levels], reconstruction [I, E])."""
    residual = x.copy()
    codes = []
    for level in range(config.levels):
        centroids, code = _kmeans(residual, config.codebook_size, config.seed + level, config, gpu)
        residual -= centroids[code]
        codes.append(code)
    return np.stack(codes, axis=1), x - residual


def _product_codes(x: np.ndarray, config: SemanticIdConfig, gpu: bool):
    """Product k-means on x [I, E]: (codes [I, pq_digits], reconstruction [I, E])."""
    n, dim = x.shape
    digits = config.pq_digits
    if dim % digits:
        raise DataError(
            f"pq_digits={digits} does not divide the embedding dimension {dim}",
            f"use --pq-digits among the divisors of {dim} (e.g. 16 or 32 for 384)",
        )
    rotation = None
    if config.opq:
        # OPQ's rotation is trained with its own PQ of 2**bits codes; few iterations suffice
        # for a catalogue of thousands (faiss's default of 50 takes minutes on CPU).
        bits = int(math.log2(config.codebook_size))
        opq_pq = faiss.ProductQuantizer(dim, digits, bits)  # kept alive: OPQ holds a raw pointer
        opq_pq.cp.min_points_per_centroid = 1
        opq_pq.cp.seed = config.seed
        rotation = faiss.OPQMatrix(dim, digits)
        rotation.niter = 8
        rotation.pq = opq_pq
        rotation.train(x)
        x = rotation.apply(x)
    chunk = dim // digits
    codes, recon = [], np.empty_like(x)
    for digit in range(digits):
        part = np.ascontiguousarray(x[:, digit * chunk : (digit + 1) * chunk])
        centroids, code = _kmeans(part, config.codebook_size, config.seed + digit, config, gpu)
        recon[:, digit * chunk : (digit + 1) * chunk] = centroids[code]
        codes.append(code)
    if rotation is not None:
        recon = rotation.reverse_transform(recon)
    return np.stack(codes, axis=1), recon


def collision_codes(codes: np.ndarray) -> np.ndarray:
    """codes [I, L] -> [I] int64: rank of each item among the items with the same codes, in
    item-index order (0 for the first, 1 for the next...)."""
    _, group, counts = np.unique(codes, axis=0, return_inverse=True, return_counts=True)
    group = group.reshape(-1)
    order = np.argsort(group, kind="stable")  # items grouped, item-index order inside a group
    group_start = np.concatenate([[0], np.cumsum(counts)[:-1]])
    rank = np.empty(len(codes), dtype=np.int64)
    rank[order] = np.arange(len(codes)) - group_start[group[order]]
    return rank


def _usage(codes: np.ndarray, size: int) -> tuple[float, float]:
    """codes [I] -> (fraction of the `size` codes used, perplexity of their usage)."""
    p = np.bincount(codes, minlength=size) / len(codes)
    p_used = p[p > 0]
    return float(len(p_used) / size), float(np.exp(-(p_used * np.log(p_used)).sum()))


def build_semantic_ids(embeddings: torch.Tensor, config: SemanticIdConfig) -> SemanticIds:
    # embeddings: [I, E] float
    """Quantise item embeddings into unique Semantic IDs (see the module docstring)."""
    start = time.perf_counter()
    if embeddings.dim() != 2 or len(embeddings) == 0:
        raise DataError(
            f"item embeddings must be a non-empty [items, dim] matrix, "
            f"got shape {tuple(embeddings.shape)}",
            "pass one embedding row per item",
        )
    x = np.ascontiguousarray(embeddings.detach().cpu().numpy(), dtype=np.float32)
    n = len(x)
    if not np.isfinite(x).all():
        raise DataError("item embeddings contain NaN or inf", "re-run the embedding step")
    if config.codebook_size > n:
        raise DataError(
            f"codebook size {config.codebook_size} is larger than the {n} items "
            "(k-means needs at least one item per code)",
            f"use --codebook-size <= {n}",
        )
    gpu = faiss.get_num_gpus() > 0 if config.use_gpu is None else config.use_gpu
    if gpu and faiss.get_num_gpus() == 0:
        raise DataError("use_gpu=True but faiss sees no GPU", "install faiss-gpu or use_gpu=None")

    quantise = _residual_codes if config.kind == "rq" else _product_codes
    codes, recon = quantise(x, config, gpu)
    collision = collision_codes(codes)
    max_group = int(collision.max()) + 1
    usage = [_usage(codes[:, level], config.codebook_size) for level in range(codes.shape[1])]
    sizes = (config.codebook_size,) * codes.shape[1]
    has_collision_level = config.kind == "rq" or max_group > 1
    if has_collision_level:
        codes = np.concatenate([codes, collision[:, None]], axis=1)
        sizes += (max_group,)
    unique = len(np.unique(codes, axis=0))
    assert unique == n, f"{n - unique} items still share a Semantic ID"
    collisions = int((collision > 0).sum())
    stats = {
        "utilisation": [u for u, _ in usage],
        "perplexity": [p for _, p in usage],
        "unique_prefixes": n - collisions,
        "collisions_before_code": collisions,
        "max_items_per_prefix": max_group,
        "quantization_mse": float(((x - recon) ** 2).sum(1).mean()),
        "seconds": time.perf_counter() - start,
        "backend": "faiss-gpu" if gpu else "faiss-cpu",
    }
    return SemanticIds(torch.from_numpy(codes), sizes, has_collision_level, stats)
