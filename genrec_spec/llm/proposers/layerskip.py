"""Self-speculative drafting (layer skip / early exit): the target's first n layers plus a
trained exit head draft a chain or a small tree, on the target's own KV cache.

The drafting itself is DraftModelProposer's (children sampled from the draft's processed
distribution with their probabilities, so rejection sampling stays lossless under temperature,
top-k and top-p; top-w children under greedy decoding). Only the cache differs: a separate
draft model keeps its own cache in step with the target's, but the early exit's committed K/V
*are* the target's first n layers (``models.llm.exit_head``), so this proposer drafts on the
target's cache handle and has nothing to commit. After each step the target has committed the
kept path and everything but the new root is cached: no uncached lead to re-feed.
"""

from __future__ import annotations

from genrec_spec.core.targets import NativeCache, NativeTarget
from genrec_spec.core.types import Acceptance, DecodeInputError, DecodeState
from genrec_spec.llm.proposers.draft_model import DraftModelProposer
from genrec_spec.models.llm.exit_head import EarlyExit


class LayerSkipProposer(DraftModelProposer):
    def __init__(
        self,
        draft: EarlyExit,
        k: int = 4,
        width: int = 1,
        children: str = "sample",
        choices: list[tuple[int, ...]] | None = None,
    ) -> None:
        """draft: the early exit of the target it will decode (``llm.training.layerskip``); k,
        width, children, choices: the tree, as DraftModelProposer's. The controller's draft cost is
        the draft's share of the target's weights (``EarlyExit.relative_cost``)."""
        super().__init__(NativeTarget(draft), k, width, children, choices, draft.relative_cost())
        self.early_exit = draft

    def begin(self, state: DecodeState) -> None:
        cache = state.cache
        if (
            not isinstance(cache, NativeCache)
            or cache.kv.k.shape[0] != self.early_exit.config.n_layers
        ):
            raise DecodeInputError(
                "layer-skip drafting runs on the target's own KV cache, and this target is not "
                "the native Llama the early exit was built from",
                "decode with that genrec_spec Llama as the target, or draft with a cache of "
                "the draft's own: DraftModelProposer(NativeTarget(early_exit))",
            )
        self.cache = cache  # the target's handle: its kv may be replaced when it grows
        self.lead = state.tokens.new_zeros(state.batch_size, 0)  # [B, 0]: nothing uncached
        self.budget = 0

    def observe(self, state: DecodeState, acceptance: Acceptance) -> None:
        """Nothing to do: the target has committed the kept path in the shared cache."""
