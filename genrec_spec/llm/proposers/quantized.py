"""Quantised self-speculation: the target's own weights at 4 bits draft a chain on the target's
KV cache (``models.llm.quantized_draft``).

The draft agrees with the target nearly always, so a chain is the right tree: a second
child at any node would rarely be tried, while each extra node costs
verification time. Greedy drafts take the draft's argmax (a deterministic draft); sampled
drafts draw from the draft's processed distribution with the same temperature / top-k / top-p
and hand that distribution to rejection sampling, so the output stays exactly the target's.

Nothing to keep in step: the draft writes its K/V past each row's committed length in the
target's cache, which the target's verification pass overwrites; the target commits the kept
path, and everything but the new root is cached for the next draft.
"""

from __future__ import annotations

import torch

from genrec_spec.core.sampling import probabilities, sample
from genrec_spec.core.targets import NativeCache
from genrec_spec.core.types import Acceptance, DecodeInputError, DecodeState, DraftTree
from genrec_spec.models.llm.quantized_draft import QuantizedDraft

# The deepest chain by default: the draft agrees with the target at nearly every position and a
# CPU pass over many tokens costs little more than a one-token pass, so long chains pay; the
# controller drafts shorter ones when they pay more. Deeper limits gain little at batch 1 and
# lose at batch 8 (docs/results/llm.md).
DEFAULT_DEPTH = 16


class QuantizedSelfProposer:
    hidden_layers: tuple[int, ...] = ()

    def __init__(
        self, draft: QuantizedDraft, k: int = DEFAULT_DEPTH, draft_cost: float | None = None
    ) -> None:
        """k: the deepest chain (the controller drafts shorter chains when they pay more);
        draft_cost: one draft step relative to a target step (default: the draft's own
        measured ratio at the batch size decoded on this machine, set by ``begin``)."""
        if k < 1:
            raise DecodeInputError(f"k={k}", "draft at least one token: k >= 1")
        self.draft = draft
        self.k = k
        self.fixed_cost = draft_cost
        self.draft_cost = draft_cost  # None: measured at the batch size decoded, by begin

    def begin(self, state: DecodeState) -> None:
        cache = state.cache
        if not isinstance(cache, NativeCache) or cache.kv.k.shape[0] != self.draft.config.n_layers:
            raise DecodeInputError(
                "the quantised draft runs on the target's own KV cache, and this target is not "
                "the native Llama the draft was built from",
                "decode with that genrec_spec Llama as the target "
                "(QuantizedDraft(target) or QuantizedDraft.from_gguf(target, path))",
            )
        self.cache = cache
        if self.fixed_cost is None:
            self.draft_cost = self.draft.relative_cost(state.batch_size)

    def propose(self, state: DecodeState, budget: int) -> DraftTree:
        kv, batch = self.cache.kv, state.batch_size
        # Room for the draft's K/V past the longest row (the target's pass needs it next anyway).
        kv.reserve(self.cache.length_bound + budget, self.draft.config.max_seq_len)
        greedy = state.sampling.greedy
        tokens, q = [state.roots], []  # per depth: [B], [B, V]
        for depth in range(budget):
            logits = self.draft.step(tokens[-1], kv, depth)  # [B, V]
            if greedy:
                tokens.append(logits.argmax(-1))
            else:
                q.append(probabilities(logits, state.sampling))
                tokens.append(sample(q[-1], state.generator))
        chain = torch.stack(tokens, dim=1)  # [B, budget + 1]
        parents = torch.arange(-1, budget, device=chain.device).expand(batch, budget + 1)
        # Node i + 1 was drawn from q[i]; the root's row is never read.
        probs = None if greedy else torch.stack([torch.zeros_like(q[0])] + q, dim=1)
        return DraftTree(tokens=chain, parents=parents.contiguous(), draft_probs=probs)

    def observe(self, state: DecodeState, acceptance: Acceptance) -> None:
        """Nothing to do: the target has committed the kept path in the shared cache."""
