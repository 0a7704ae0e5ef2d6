"""Trie-constrained beam search over Semantic-ID codes (TIGER's decoder, the baseline).

    decode(model, values, offsets, *, k, trie, beam_width=None) -> Recommendations

One `encode_history` pass gives the level-0 log-probs; then one `score_tree` pass per further
level scores the current beams' prefixes (the beams of every earlier level form one tree per
row, linked by which beam each came from, so shared prefixes are scored once). At every level
the codes that lead to no item are masked with the valid-ID trie before the top-W selection, so
every finished beam is an item. An item's score is the sum of its levels' log-probs: the exact
log-likelihood of its full code tuple under the model. The last level is the collision code.

Tie-breaking (deterministic, and what `spec_beam` reproduces): the candidates of a level are
ordered by score, descending; equal scores keep the order of (parent beam's rank, code), i.e. a
stable sort over the flattened [W, V] candidates.

Shape letters: B users, W beams, V codes of a level, N tree nodes, L code levels, K results.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import Tensor

from genrec_spec.data_pipelines.trie import PrefixTrie
from genrec_spec.recsys.types import Recommendations

DEFAULT_MIN_BEAM_WIDTH = 20  # beam width when none is given: max(k, this)


class DecodeOptionError(ValueError):
    """A decoder option that cannot work (beam width < k, k < 1, a mismatched trie, ...)."""


@dataclass(frozen=True)
class Beams:
    """The W best prefixes of one length per row, best first."""

    codes: Tensor  # [B, W, l] int64 the prefix's codes (levels 0..l-1)
    nodes: Tensor  # [B, W] int64 trie node of the prefix; -1 = empty beam (too few prefixes)
    scores: Tensor  # [B, W] float32 sum of the prefix's log-probs; -inf for empty beams
    origin: Tensor  # [B, W] int64 index of the beam of length l - 1 this one extends


def beam_width_for(k: int, beam_width: int | None, num_items: int) -> int:
    """The beam width to use; raises on k < 1, a width below k, or k over the catalogue."""
    if k < 1:
        raise DecodeOptionError(f"k must be >= 1, got {k}")
    if k > num_items:
        raise DecodeOptionError(
            f"k = {k} is larger than the catalogue ({num_items} items); ask for k <= {num_items}"
        )
    width = max(k, DEFAULT_MIN_BEAM_WIDTH) if beam_width is None else int(beam_width)
    if width < k:
        raise DecodeOptionError(f"beam_width {width} must be >= k = {k}")
    return width


def check_trie(model, trie: PrefixTrie) -> None:
    """The trie must describe the model's catalogue (same levels, codebook sizes and items)."""
    if (
        tuple(trie.codebook_sizes) != tuple(model.codebook_sizes)
        or len(trie.leaf_items) != model.num_items
    ):
        raise DecodeOptionError(
            f"trie (codebook sizes {tuple(trie.codebook_sizes)}, {len(trie.leaf_items)} items) "
            f"does not match the model ({tuple(model.codebook_sizes)}, {model.num_items} items); "
            "build it with PrefixTrie.from_codes(model.item_codes, model.codebook_sizes)"
        )


def start_beams(batch: int, trie: PrefixTrie) -> Beams:
    """One beam per row: the empty prefix at the trie root, score 0."""
    origin = torch.zeros(batch, 1, dtype=torch.long, device=trie.device)
    return Beams(
        codes=origin[:, :, None][:, :, :0],
        nodes=trie.root(batch)[:, None],
        scores=torch.zeros(batch, 1, device=trie.device),
        origin=origin,
    )


def extend(
    beams: Beams,  # prefixes of length `level`
    log_probs: Tensor,  # [B, W, >= V] log-probs of the next code (level `level`) per beam
    trie: PrefixTrie,
    level: int,
    width: int,
) -> Beams:  # the `width` best valid prefixes of length level + 1
    """One beam step: mask codes that lead to no item, keep the top `width` (module docstring
    for the tie-breaking)."""
    batch, beams_in = beams.nodes.shape
    vocab = trie.codebook_sizes[level]
    allowed = trie.allowed_mask(beams.nodes.flatten(), level).view(batch, beams_in, vocab)
    candidates = beams.scores[:, :, None] + log_probs[:, :, :vocab]
    candidates = candidates.masked_fill(~allowed, float("-inf")).flatten(1)  # [B, W * V]
    width = min(width, candidates.shape[1])
    ranked = torch.sort(candidates, dim=1, descending=True, stable=True)
    scores, flat = ranked.values[:, :width], ranked.indices[:, :width]  # [B, W']
    origin, code = flat // vocab, flat % vocab
    parent_nodes = beams.nodes.gather(1, origin)
    nodes = trie.child(parent_nodes.flatten(), code.flatten()).view(batch, width)
    real = torch.isfinite(scores)
    prefix = beams.codes.gather(1, origin[:, :, None].expand(-1, -1, level))
    return Beams(
        codes=torch.cat([prefix, code[:, :, None]], dim=2),
        nodes=torch.where(real, nodes, -1),
        scores=scores,
        origin=origin,
    )


def beam_tree(history: list[Beams]) -> tuple[Tensor, Tensor, Tensor]:
    """The prefixes of all beams of lengths 1..l as one tree per row: node d * W + w is beam w
    of length d + 1, its parent the beam it extends. Returns codes, levels, parents, each
    [B, l * W]; the last W nodes are the current beams."""
    codes, levels, parents = [], [], []
    for depth, beams in enumerate(history):
        codes.append(beams.codes[:, :, -1])
        levels.append(torch.full_like(beams.nodes, depth))
        start = sum(b.nodes.shape[1] for b in history[: depth - 1])
        parents.append(beams.origin + start if depth else torch.full_like(beams.nodes, -1))
    return torch.cat(codes, 1), torch.cat(levels, 1), torch.cat(parents, 1)


def finish(
    beams: Beams,  # full code tuples (length L)
    trie: PrefixTrie,
    k: int,
) -> tuple[Tensor, Tensor]:  # items [B, K] (-1 pads), scores [B, K] (-inf pads)
    leaf = (beams.nodes[:, :k] - trie.level_starts[-2]).clamp(min=0)
    real = beams.nodes[:, :k] >= 0
    items = torch.where(real, trie.leaf_items[leaf], -1)
    scores = beams.scores[:, :k]
    if items.shape[1] < k:  # fewer candidates than k in the whole last level
        pad = k - items.shape[1]
        items = torch.nn.functional.pad(items, (0, pad), value=-1)
        scores = torch.nn.functional.pad(scores, (0, pad), value=float("-inf"))
    return items, scores


@torch.no_grad()
def decode(
    model,  # SemanticIdRecommender
    values: Tensor,  # [M] int64 history item indices, oldest first within a row
    offsets: Tensor,  # [B+1] int64
    *,
    k: int,
    trie: PrefixTrie,
    beam_width: int | None = None,  # W >= k; None = max(k, DEFAULT_MIN_BEAM_WIDTH)
) -> Recommendations:
    start_time = time.perf_counter()
    width = beam_width_for(k, beam_width, model.num_items)
    check_trie(model, trie)
    state = model.encode_history(values, offsets)
    batch = state.lengths.numel()
    beams = extend(start_beams(batch, trie), state.level0_log_probs[:, None], trie, 0, width)
    history, nodes_scored = [beams], 0
    for level in range(1, model.num_levels):
        codes, levels, parents = beam_tree(history)
        out = model.score_tree(state, codes, levels, parents)  # [B, N, Vmax]
        nodes_scored += codes.numel()
        beams = extend(beams, out[:, -beams.nodes.shape[1] :], trie, level, width)
        history.append(beams)
    items, scores = finish(beams, trie, k)
    return Recommendations(
        items=items,
        scores=scores,
        stats={
            "target_passes": model.num_levels,
            "nodes_scored": nodes_scored,
            "wall_time_s": time.perf_counter() - start_time,
            "truncated_histories": int(state.truncated.sum()),
        },
    )
