"""Jagged batches of user histories: values + offsets <-> padded dense, and torchrec KJTs.

A batch of B user histories is ragged: ``values`` holds every history item of the batch
back to back (M items in all, oldest first within a row) and ``offsets`` (length B+1,
``offsets[0] == 0``, ``offsets[-1] == M``) says where each row starts and ends. Models
consume it either as a torchrec ``KeyedJaggedTensor`` (embedding tables) or as a
right-padded dense tensor [B, T] (a transformer over time). The dense conversions have
an fbgemm path (the fused ops production recommenders use, CPU and CUDA) and a pure-torch
path; ``backend="auto"`` takes fbgemm when it is installed, and the tests prove the two equal.

When a row is longer than the T a model can read, the *most recent* T items are kept:
the next item depends most on the latest ones.

Shape letters: B users, M history items in the whole batch, T padded length, L code
levels, I items in the catalogue, E feature width.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Literal

import torch
from torch import Tensor

from genrec_spec.data_pipelines.errors import DataError

if TYPE_CHECKING:  # torchrec is slow to import: only `history_kjt` loads it, lazily.
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

Backend = Literal["auto", "fbgemm", "torch"]

# Keys of the KJT built by `history_kjt`: the item index, then one key per code level.
ITEM_KEY = "item"


def code_key(level: int) -> str:
    """KJT key of semantic-code level ``level`` (``code_0`` is the coarsest)."""
    return f"code_{level}"


def _use_fbgemm(backend: Backend) -> bool:
    """True when the fbgemm ops should run; importing fbgemm_gpu registers them."""
    if backend not in ("auto", "fbgemm", "torch"):
        raise DataError(
            f"unknown jagged backend {backend!r}", "pass backend='auto', 'fbgemm' or 'torch'"
        )
    if backend == "torch":
        return False
    try:
        importlib.import_module("fbgemm_gpu")
    except ImportError as err:
        if backend == "auto":
            return False
        raise ModuleNotFoundError(
            "backend='fbgemm' needs the fbgemm_gpu package, which is not importable "
            f"({err}). Install fbgemm-gpu-cpu==1.8.0 (CPU) or fbgemm-gpu==1.8.0 (CUDA) to "
            "match torch 2.13, or pass backend='torch'."
        ) from err
    return True


def _check_offsets(offsets: Tensor, num_values: int | None) -> Tensor:
    """Validate ``offsets`` [B+1] for ``num_values`` values (None: any); returns them as int64."""
    if offsets.dim() != 1 or offsets.numel() == 0 or offsets.is_floating_point():
        raise DataError(
            f"offsets must be a 1-D integer tensor of length B+1, got dtype {offsets.dtype} "
            f"and shape {tuple(offsets.shape)}",
            "build them with lengths_to_offsets(lengths)",
        )
    offsets = offsets.long()
    if int(offsets[0]) != 0:
        raise DataError(
            f"offsets must start at 0, got {int(offsets[0])}",
            "pass offsets of length B+1 built with lengths_to_offsets(lengths)",
        )
    if num_values is not None and int(offsets[-1]) != num_values:
        raise DataError(
            f"offsets must end at the number of values ({num_values}), got {int(offsets[-1])}",
            "pass the offsets that belong to these values (length B+1)",
        )
    if bool((offsets[1:] < offsets[:-1]).any()):
        raise DataError(
            "offsets must be non-decreasing (a row cannot have negative length)",
            "build them with lengths_to_offsets(lengths) from non-negative lengths",
        )
    return offsets


def _check_lengths(lengths: Tensor) -> Tensor:
    """Validate ``lengths`` [B]; returns them as int64."""
    if lengths.dim() != 1 or lengths.is_floating_point():
        raise DataError(
            f"lengths must be a 1-D integer tensor [B], got dtype {lengths.dtype} "
            f"and shape {tuple(lengths.shape)}",
            "pass one non-negative row length per user",
        )
    if bool((lengths < 0).any()):
        raise DataError("lengths must be non-negative", "pass one row length >= 0 per user")
    return lengths.long()


def lengths_to_offsets(
    lengths: Tensor,  # [B] row lengths
    backend: Backend = "auto",
) -> Tensor:  # [B+1] int64, starting at 0
    """Offsets ``[0, l0, l0+l1, ...]``: row b spans ``values[offsets[b]:offsets[b+1]]``."""
    lengths = _check_lengths(lengths)
    if _use_fbgemm(backend):
        return torch.ops.fbgemm.asynchronous_complete_cumsum(lengths)
    return torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])


def offsets_to_lengths(
    offsets: Tensor,  # [B+1] starting at 0
) -> Tensor:  # [B] int64
    """Row lengths of a jagged batch."""
    offsets = _check_offsets(offsets, None)
    return offsets[1:] - offsets[:-1]


def row_positions(offsets: Tensor, num_values: int) -> tuple[Tensor, Tensor]:
    """Row index [M] and position within the row [M] of every value (offsets [B+1], M values):
    also how ranges of different lengths are spelled out, one row a range."""
    lengths = offsets[1:] - offsets[:-1]  # [B]
    rows = torch.arange(lengths.numel(), device=offsets.device)  # [B]
    row = torch.repeat_interleave(rows, lengths, output_size=num_values)  # [M]
    position = torch.arange(num_values, device=offsets.device) - offsets[row]  # [M]
    return row, position


def spell_out_ranges(
    starts: Tensor,  # [R] each range's first value
    lengths: Tensor,  # [R] each range's length, >= 0
) -> tuple[Tensor, Tensor]:  # ([T], [T]), T = lengths.sum()
    """Ranges of consecutive integers written out, range by range: each value's range index and
    the value (starts[r], starts[r] + 1, ..., starts[r] + lengths[r] - 1 for range r)."""
    offsets = lengths_to_offsets(lengths, backend="torch")  # (small rows: no fbgemm call)
    owner, within = row_positions(offsets, int(offsets[-1]))
    return owner, starts[owner] + within


def truncate_jagged(
    values: Tensor,  # [M] or [M, E]
    offsets: Tensor,  # [B+1]
    max_len: int,
) -> tuple[Tensor, Tensor]:  # ([M'] or [M', E], [B+1])
    """Keep the last ``max_len`` values of every row (the most recent history)."""
    if max_len < 0:
        raise DataError(f"max_len must be >= 0, got {max_len}", "pass the longest history to keep")
    offsets = _check_offsets(offsets, values.shape[0])
    lengths = offsets[1:] - offsets[:-1]  # [B]
    row, position = row_positions(offsets, values.shape[0])  # [M], [M]
    dropped = (lengths - max_len).clamp(min=0)  # [B] oldest items cut from each row
    keep = position >= dropped[row]  # [M]
    return values[keep], lengths_to_offsets(lengths - dropped, backend="torch")


def jagged_to_padded(
    values: Tensor,  # [M] or [M, E]
    offsets: Tensor,  # [B+1]
    max_len: int,
    pad_value: float,
    backend: Backend = "auto",
) -> Tensor:  # [B, T] or [B, T, E] with T = max_len
    """Right-padded dense batch; rows longer than ``max_len`` keep their last ``max_len`` items.

    With the fbgemm backend ``pad_value`` passes through a double, so integer pads must be
    below 2**53 in magnitude.
    """
    if values.dim() not in (1, 2):
        raise DataError(
            f"values must be [M] or [M, E], got shape {tuple(values.shape)}",
            "flatten the per-item features to one dimension",
        )
    # fbgemm's op would keep the *first* T items of a long row; cut to the last T up front.
    values, offsets = truncate_jagged(values, offsets, max_len)
    if _use_fbgemm(backend):
        return torch.ops.fbgemm.jagged_to_padded_dense(values, [offsets], [max_len], pad_value)
    batch = offsets.numel() - 1
    padded = values.new_full((batch, max_len, *values.shape[1:]), pad_value)  # [B, T(, E)]
    row, position = row_positions(offsets, values.shape[0])  # [M], [M]
    padded[row, position] = values
    return padded


def padded_to_jagged(
    padded: Tensor,  # [B, T] or [B, T, E], right-padded
    lengths: Tensor,  # [B] valid prefix length of each row, <= T
    backend: Backend = "auto",
) -> tuple[Tensor, Tensor]:  # (values [M] or [M, E], offsets [B+1])
    """Inverse of `jagged_to_padded` for rows that fit: drop each row's right padding."""
    lengths = _check_lengths(lengths)
    if padded.dim() not in (2, 3) or padded.shape[0] != lengths.numel():
        raise DataError(
            f"padded must be [B, T] or [B, T, E] with B = len(lengths) = {lengths.numel()}, "
            f"got shape {tuple(padded.shape)}",
            "pass one length per padded row",
        )
    if bool((lengths > padded.shape[1]).any()):
        raise DataError(
            f"a row length exceeds the padded width T = {padded.shape[1]}",
            "pass lengths clamped to T (the number of valid leading entries per row)",
        )
    offsets = lengths_to_offsets(lengths, backend)  # [B+1]
    if _use_fbgemm(backend):
        # dense_to_jagged wants a trailing feature dimension.
        dense = padded if padded.dim() == 3 else padded.unsqueeze(-1)  # [B, T, E]
        values = torch.ops.fbgemm.dense_to_jagged(dense, [offsets])[0]  # [M, E]
        return (values if padded.dim() == 3 else values.squeeze(-1)), offsets
    time = torch.arange(padded.shape[1], device=padded.device)  # [T]
    valid = time[None, :] < lengths[:, None]  # [B, T]
    return padded[valid], offsets


def history_kjt(
    item_values: Tensor,  # [M] item indices into `codes`, oldest first within a row
    offsets: Tensor,  # [B+1]
    codes: Tensor,  # [I, L] int64 semantic code of every item
    max_len: int | None = None,
) -> KeyedJaggedTensor:  # keys item, code_0..code_{L-1}; each key has B rows, M values
    """User histories as a torchrec ``KeyedJaggedTensor`` for ``EmbeddingCollection`` tables.

    Every key has the same row lengths: key ``item`` holds the item indices, key
    ``code_l`` the level-l code of each of those items. ``max_len`` keeps only the most
    recent ``max_len`` items per row.
    """
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    if item_values.dim() != 1 or item_values.is_floating_point():
        raise DataError(
            f"item_values must be a 1-D integer tensor [M], got dtype {item_values.dtype} "
            f"and shape {tuple(item_values.shape)}",
            "pass the flattened item indices of all histories",
        )
    if codes.dim() != 2 or codes.is_floating_point():
        raise DataError(
            f"codes must be an integer table [I, L], got dtype {codes.dtype} "
            f"and shape {tuple(codes.shape)}",
            "pass one row of L semantic codes per item",
        )
    num_items = codes.shape[0]
    if item_values.numel() and (int(item_values.min()) < 0 or int(item_values.max()) >= num_items):
        raise DataError(
            f"item indices must lie in [0, {num_items}) to index the codes table",
            "map raw item ids to rows of the codes table first",
        )
    offsets = _check_offsets(offsets, item_values.numel())
    if max_len is not None:
        item_values, offsets = truncate_jagged(item_values, offsets, max_len)
    lengths = offsets[1:] - offsets[:-1]  # [B]
    items = item_values.long()  # [M]
    per_key = torch.cat([items[None, :], codes[items].long().T])  # [1+L, M]
    # KJT layout is key-major: all rows of key 0, then all rows of key 1, ...
    return KeyedJaggedTensor(
        keys=[ITEM_KEY] + [code_key(level) for level in range(codes.shape[1])],
        values=per_key.reshape(-1),  # [(1+L) * M]
        lengths=lengths.repeat(per_key.shape[0]),  # [(1+L) * B]
    )
