"""Collaborative item embeddings from the training histories, for semantic IDs that group items
users consume together, not only items whose titles read alike.

Text embeddings alone put a movie next to movies with similar titles; a next-item model then
has to learn, code by code, which unrelated-looking clusters follow each other. A collaborative
vector places items by who watched them: the truncated SVD of the user x item matrix of the
TRAINING histories (valid and test targets never enter: no leakage into the IDs), with each
entry 1 / sqrt(|user| |item|) (the symmetric normalisation of LightGCN / normalised co-occurrence,
so heavy users and blockbusters do not own the leading directions). Item i's vector is row i of
V S^(1/2), L2-normalised; items absent from training get zeros (their IDs then come from the
text part alone when the two are mixed).

`mix_embeddings` joins text and collaborative vectors into the vectors the quantisers cut:
[sqrt(1 - w) text, sqrt(w) cf] (each part unit-norm, so w is the share of squared distance the
collaborative part contributes).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from genrec_spec.data_pipelines.errors import DataError


def cf_embeddings(
    values: np.ndarray,  # [M] int64 item indices of the training histories
    offsets: np.ndarray,  # [U+1] int64 history bounds
    num_items: int,  # I
    dim: int = 64,
    seed: int = 0,
) -> torch.Tensor:  # [I, dim] float32, unit rows (zeros for items never in training)
    """The normalised user x item matrix's top-``dim`` right singular vectors, scaled by the
    square roots of the singular values (module docstring)."""
    users = len(offsets) - 1
    if dim < 1 or dim >= min(users, num_items):
        raise DataError(
            f"collaborative embedding dim {dim} is out of range for {users} users and "
            f"{num_items} items",
            f"use --cf-dim between 1 and {min(users, num_items) - 1}",
        )
    rows = np.repeat(np.arange(users), np.diff(offsets))  # [M] user of each interaction
    pairs = np.unique(np.stack([rows, values]), axis=1)  # [2, M'] each user-item pair once
    user_degree = np.bincount(pairs[0], minlength=users)
    item_degree = np.bincount(pairs[1], minlength=num_items)
    weights = 1.0 / np.sqrt(user_degree[pairs[0]] * item_degree[pairs[1]])
    matrix = torch.sparse_coo_tensor(
        torch.from_numpy(pairs),
        torch.from_numpy(weights),
        (users, num_items),
        check_invariants=True,
    ).coalesce()  # [U, I] float64
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        _, singular, right = torch.svd_lowrank(matrix, q=dim, niter=6)  # [dim], [I, dim]
    vectors = (right * singular.sqrt()).float()  # [I, dim]
    return F.normalize(vectors, dim=1)  # zero rows (unseen items) stay zero


def mix_embeddings(
    text: torch.Tensor,  # [I, E] unit rows
    cf: torch.Tensor,  # [I, C] unit or zero rows
    cf_weight: float,  # w in [0, 1]
) -> torch.Tensor:  # [I, E + C] float32
    """Text and collaborative vectors side by side, weighted (module docstring)."""
    return torch.cat([text * (1 - cf_weight) ** 0.5, cf * cf_weight**0.5], dim=1)
