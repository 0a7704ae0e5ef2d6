"""k-means trained on a sample of the rows and assigned in batches, over a matrix that may be
larger than memory (an in-memory array, or `NpyRows` on disk).

faiss trains a k-means of k codes on at most k x max_points_per_centroid rows: above that it
draws them itself, the first rows of `faiss.rand_perm(n, seed)`. `training_rows` names those same
rows, so a k-means trained here on the rows gathered from disk has exactly the centroids that
faiss would give handed the whole matrix (the same data, in the same order, the same
initialisation). `gather_rows` collects the rows of several samples in one sequential pass;
`assign` maps a batch to its nearest centroids, a row's code not depending on the batch it is in.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import faiss
import numpy as np

from genrec_spec.data_pipelines.errors import DataError
from genrec_spec.data_pipelines.npy_rows import row_batches


def training_rows(rows: int, k: int, points_per_code: int, seed: int) -> np.ndarray | None:
    # -> [k * points_per_code] int64 row ids in faiss's order, or None: every row, in order
    """The rows faiss trains a k-means of `k` codes (seeded `seed`) on, given `rows` rows."""
    sample = k * points_per_code
    if rows <= sample:
        return None
    if rows >= 2**31:
        raise DataError(
            f"{rows} rows are more than faiss's sampling permutation can index",
            "quantise fewer than 2^31 items at once",
        )
    perm = np.empty(rows, dtype=np.int32)
    faiss.rand_perm(faiss.swig_ptr(perm), rows, seed)
    return perm[:sample].astype(np.int64)


Request = tuple[np.ndarray | None, slice]  # (row ids [m] or None: every row, the columns)


def gather_rows(
    x, requests: Sequence[Request], batch: int, transform: Callable | None = None
) -> list[np.ndarray]:
    # x: [N, E] array or NpyRows -> one [m, columns] array per request
    """For each request (row ids [m] in the order wanted, or None for every row; the columns
    wanted), those rows' columns, read in one pass over x and first mapped by `transform`
    ([b, E] -> [b, E'], e.g. a rotation) if given. Refuses rows that are not finite before any
    k-means runs on them. Every result is a fresh array, the caller's to change."""
    plans = []  # (sorted row ids, their order in the request) or None
    for rows, _ in requests:
        order = None if rows is None else np.argsort(rows, kind="stable")
        plans.append(None if rows is None else (rows[order], order))
    parts: list[list[np.ndarray]] = [[] for _ in requests]
    for start, block in row_batches(x, batch):
        if not np.isfinite(block).all():
            raise DataError("item embeddings contain NaN or inf", "re-run the embedding step")
        block = block if transform is None else transform(block)
        for plan, (_, columns), part in zip(plans, requests, parts, strict=True):
            if plan is None:
                part.append(block[:, columns])
                continue
            lo, hi = np.searchsorted(plan[0], [start, start + len(block)])
            part.append(block[plan[0][lo:hi] - start, columns])
    out = []
    for plan, part in zip(plans, parts, strict=True):
        rows = np.concatenate(part)  # a copy, even of a single view of x
        if plan is not None:
            rows[plan[1]] = rows.copy()  # sorted row-id order -> the request's order
        out.append(rows)
    return out


def train_kmeans(
    x: np.ndarray,  # [m, d] float32: the training rows (`training_rows` of the whole matrix)
    k: int,
    seed: int,
    niter: int,
    max_points_per_centroid: int,
    gpu: bool,
) -> faiss.Kmeans:
    km = faiss.Kmeans(
        x.shape[1],
        k,
        niter=niter,
        seed=seed,
        gpu=gpu,
        # Small catalogues have few items per code: faiss's default minimum of points per
        # centroid would only print warnings here.
        min_points_per_centroid=1,
        max_points_per_centroid=max_points_per_centroid,
    )
    km.train(np.ascontiguousarray(x, dtype=np.float32))
    return km


def assign(km: faiss.Kmeans, x: np.ndarray) -> np.ndarray:  # x: [b, d] -> [b] int64 codes
    _, code = km.assign(np.ascontiguousarray(x, dtype=np.float32))
    return code.astype(np.int64)
