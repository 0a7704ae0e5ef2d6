"""Prompt lookup: where a text's last n tokens occurred before, what followed them is a likely
continuation (prompt lookup decoding). Model-free, so its drafts cost no forward pass.

    follow = continuation_starts(tokens, lengths, max_ngram=3, min_ngram=1)  # [R] -1: none

``generate`` drafts the continuation as a chain (``llm.proposers.ngram.PromptLookup``); beam
search drafts one below every beam (``PromptLookupDrafter``), each beam's text being its row's
prompt and its own path, so an unconstrained beam search is speculative too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from genrec_spec.core.beam_tree import BeamTree, rank_within_rows
from genrec_spec.core.types import DecodeInputError


def continuation_starts(
    tokens: Tensor,  # [R, T] texts, right-padded
    lengths: Tensor,  # [R] their lengths
    max_ngram: int,
    min_ngram: int,
) -> Tensor:  # [R] where each text's continuation starts in it; -1 where no n-gram recurs
    """For each text, the position after the most recent earlier occurrence of its last n
    tokens, the longest n in max_ngram..min_ngram that occurs earlier."""
    width = tokens.shape[1]
    follow = torch.full_like(lengths, -1)
    for n in range(max_ngram, min_ngram - 1, -1):
        if n >= width:
            continue
        suffix_start = lengths - n  # [R]
        suffix = tokens.gather(
            1, (suffix_start[:, None] + torch.arange(n, device=tokens.device)).clamp_min(0)
        )  # [R, n]
        match = (tokens.unfold(1, n, 1) == suffix[:, None, :]).all(-1)  # [R, T - n + 1]
        starts = torch.arange(match.shape[1], device=tokens.device)
        # An earlier occurrence: it starts before the suffix, so a token follows it.
        match &= (starts < suffix_start[:, None]) & (suffix_start[:, None] >= 0)
        latest = torch.where(match, starts, -1).max(-1).values
        follow = torch.where((follow < 0) & (latest >= 0), latest + n, follow)
    return follow


@dataclass
class PromptLookupDrafter:
    """A ``BeamDrafter``: below every live beam, the chain of up to ``depth`` tokens that
    followed the last occurrence of the beam's last n tokens in its text (its row's prompt and
    its path), in the rows where every live beam has one. Drafts only add nodes a pass scores,
    so the search's output is unchanged. It keeps the prompts of the search it serves (``begin``):
    one search at a time."""

    depth: int = 4
    max_ngram: int = 3
    min_ngram: int = 1
    prompts: list[list[int]] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram or self.depth < 1:
            raise DecodeInputError(
                f"depth={self.depth}, min_ngram={self.min_ngram}, max_ngram={self.max_ngram}",
                "use depth >= 1 and 1 <= min_ngram <= max_ngram",
            )

    def begin(self, tokens: Tensor, lengths: Tensor) -> None:
        """``BeamDrafter.begin``: keep the prompts (the texts the beams continue)."""
        self.prompts = [row[:n] for row, n in zip(tokens.tolist(), lengths.tolist(), strict=True)]

    def draft(self, tree: BeamTree, rows: Tensor, nodes: Tensor, budget: int, cache) -> None:
        """``BeamDrafter.draft``: each beam's continuation, a level at a time (so a small
        budget goes to the nearest nodes of every beam first); the target's cache is not read."""
        where = rows.tolist()
        paths = tree.paths(where, nodes.tolist())
        texts = [self.prompts[r] + path for r, path in zip(where, paths, strict=True)]
        lengths = torch.tensor([len(t) for t in texts], device=tree.device)  # [F]
        # [F] how many tokens each chain may add before it would pass the deepest beam
        room = tree.max_depth - torch.tensor([len(p) for p in paths], device=tree.device)
        widest = int(lengths.max())
        padded = torch.tensor([t + [0] * (widest - len(t)) for t in texts], device=tree.device)
        at = continuation_starts(padded, lengths, self.max_ngram, self.min_ngram)  # [F]
        # A pass is saved only when every live beam of every row reaches a scored node, so a
        # row with a beam that has no continuation drafts nothing: its drafts would only cost.
        unmatched = torch.zeros(tree.batch, device=tree.device).index_add_(
            0, rows, (at < 0).float()
        )  # [B]
        at = torch.where(unmatched[rows] > 0, -1, at)
        left = torch.full((tree.batch,), budget, device=tree.device)
        for level in range(self.depth):
            kept = (at >= 0) & (at < lengths) & (level < room)  # a token follows, in reach
            rows, nodes, at, padded, lengths, room = (
                rows[kept],
                nodes[kept],
                at[kept],
                padded[kept],
                lengths[kept],
                room[kept],
            )
            if not len(rows):
                return
            tokens = padded.gather(1, at[:, None])[:, 0]  # [F'] each beam's next drafted token
            child = tree.child(rows, nodes, tokens)  # -1: not planned yet
            new = (child < 0).nonzero()[:, 0]
            take = new[rank_within_rows(rows[new]) < left[rows[new]]]
            rows_t, nodes_t, tokens_t = rows[take], nodes[take], tokens[take]
            child[take] = tree.add(rows_t, nodes_t, tokens_t)
            left -= torch.bincount(rows[take], minlength=tree.batch)
            nodes, at = child, at + 1  # over budget (-1): nothing below it either
            at = torch.where(nodes >= 0, at, -1)
