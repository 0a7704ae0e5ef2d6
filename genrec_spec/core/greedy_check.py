"""Is a greedy decoder's output plain greedy decoding's output? Token for token, or diverging
only where the target's top-2 logits are a numerical tie.

Two correct greedy decoders can still part ways: when two tokens' logits are within float
noise, a tree-scoring forward (different matrix shapes, different reduction order) may pick the
other one, and everything after differs. Such a divergence is not a bug; any other is. Used by
the core's SmolLM2 greedy-equality tests and by ``genrec-spec bench llm``'s ``exact`` column.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from genrec_spec.core.decode import pack_prompts
from genrec_spec.core.targets import as_target
from genrec_spec.core.tree import root_only

TIE = 1e-4  # top-2 logit gap below which the target's argmax is a numerical tie


def first_divergence(expected: Sequence[int], got: Sequence[int]) -> int | None:
    """Index of the first generated token where the two differ (a length difference counts at
    the shorter length), or None when they are identical."""
    for i, (a, b) in enumerate(zip(expected, got, strict=False)):
        if a != b:
            return i
    return None if len(expected) == len(got) else min(len(expected), len(got))


def compare_greedy(
    target: object,
    prompts: Sequence[Sequence[int]],
    expected: Sequence[Sequence[int]],
    got: Sequence[Sequence[int]],
    tie: float = TIE,
) -> list[str]:
    """Per row: "yes" (identical), "tie@i" (first differs at generated token i, where the
    target's top-2 logits after prompt + expected[:i] are less than ``tie`` apart and the two
    tokens emitted there are exactly that pair) or "no@i".

    target: the model that decoded ``expected`` greedily (anything ``as_target`` accepts);
    prompts, expected, got: token ids per row. The logits of all diverging rows come from one
    batched forward."""
    verdicts = ["yes"] * len(prompts)
    diverging = {}  # row -> first differing position
    for row, (want, have) in enumerate(zip(expected, got, strict=True)):
        position = first_divergence(want, have)
        if position is not None:
            diverging[row] = position
    if not diverging:
        return verdicts
    contexts = [list(prompts[row]) + list(expected[row][:i]) for row, i in diverging.items()]
    model = as_target(target)
    tokens, lengths = pack_prompts(contexts)
    with torch.inference_mode():
        cache = model.prefill(tokens, lengths, tokens.shape[1] + 1)
        roots = tokens.gather(1, (lengths - 1)[:, None]).squeeze(1)
        top2 = model.score_tree(cache, root_only(roots))[:, 0].topk(2)  # [R, 2] each
    gaps = (top2.values[:, 0] - top2.values[:, 1]).tolist()
    pairs = top2.indices.tolist()
    for (row, position), gap, pair in zip(diverging.items(), gaps, pairs, strict=True):
        emitted = {_at(expected[row], position), _at(got[row], position)}
        tied = gap < tie and emitted == set(pair)
        verdicts[row] = f"{'tie' if tied else 'no'}@{position}"
    return verdicts


def _at(tokens: Sequence[int], i: int) -> int | None:  # None past the end: never a tied token
    return tokens[i] if i < len(tokens) else None
