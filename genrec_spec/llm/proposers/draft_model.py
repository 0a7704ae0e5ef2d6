"""Draft-model speculation: a cheaper model with the target's tokenizer drafts a chain or a
tree, one draft forward per tree level, with its probabilities for rejection sampling.

The draft is any target-like object (``CallableTarget``, ``HFTarget``, ``NativeTarget``, a
transformers model or the project's Llama). Children per node:
- "sample": distinct tokens sampled without replacement (Gumbel-top-w) from the draft's
  processed distribution; each child carries its conditional distribution (the draft's with
  its earlier siblings removed), as the exact multi-draft rule needs;
- "iid": independent samples (SpecInfer), duplicates possible, each carrying the draft's q;
- "top": the w most likely tokens, a deterministic draft (draft_probs None).
Greedy decoding always drafts deterministically.

Keeping the draft's cache in step with the target: after a step the draft commits every kept
path node except the last, which it re-feeds (with the new root) at the head of its next
pass. That makes the uncached lead the same length on every row whatever each row accepted,
so one batched forward serves all rows. Finished rows commit nothing.
"""

from __future__ import annotations

import torch
from torch import Tensor

from genrec_spec.core.sampling import probabilities, sample, sample_without_replacement
from genrec_spec.core.targets import as_target
from genrec_spec.core.tree import prepend_chain, static_levels, static_tree, widths_to_choices
from genrec_spec.core.types import (
    Acceptance,
    DecodeInputError,
    DecodeState,
    DraftTree,
    SamplingParams,
)

CHILDREN = ("sample", "iid", "top")


class DraftModelProposer:
    def __init__(
        self,
        draft: object,
        k: int = 4,
        width: int = 1,
        children: str = "sample",
        choices: list[tuple[int, ...]] | None = None,
        draft_cost: float = 0.5,
    ) -> None:
        """k: draft depth; width: children of the root (deeper nodes get one child), or
        choices: any static tree (Medusa-style rank paths, overrides k and width);
        draft_cost: one draft forward's cost relative to a target forward (for the
        controller)."""
        if children not in CHILDREN:
            raise DecodeInputError(
                f"children={children!r} is not one of {CHILDREN}", "pick 'sample', 'iid' or 'top'"
            )
        if choices is None and (k < 1 or width < 1):
            raise DecodeInputError(f"k={k}, width={width}", "use k >= 1 and width >= 1")
        self.draft = as_target(draft)
        self.children = children
        self.draft_cost = draft_cost
        self.hidden_layers: tuple[int, ...] = ()
        choices = choices or widths_to_choices((width,) + (1,) * (k - 1))
        self.parents, ranks, depth = static_tree(choices)  # [N] each
        self.levels = static_levels(self.parents, ranks, depth)
        self.k = len(self.levels)

    def begin(self, state: DecodeState) -> None:
        width = int(state.prompt_lengths.max())
        self.cache = self.draft.prefill(
            state.tokens[:, :width], state.prompt_lengths, state.tokens.shape[1]
        )
        if self.draft.vocab_size != state.vocab_size:
            raise DecodeInputError(
                f"the draft's vocabulary has {self.draft.vocab_size} tokens but the target's has "
                f"{state.vocab_size}",
                "draft with a model that shares the target's tokenizer (no cross-tokenizer "
                "mapping is implemented)",
            )
        self.lead = state.tokens.new_zeros(state.batch_size, 0)  # [B, M] uncached tokens
        self.budget = 0

    def propose(self, state: DecodeState, budget: int) -> DraftTree:
        batch, device = state.batch_size, state.tokens.device
        levels = self.levels[:budget]
        n = levels[-1].end
        parents = self.parents[:n].to(device).expand(batch, n)
        tokens = state.tokens.new_zeros(batch, n)
        tokens[:, 0] = state.roots
        valid = torch.ones(batch, n, dtype=torch.bool, device=device)
        deterministic = self.children == "top" or state.sampling.greedy
        q_all = None if deterministic else torch.zeros(batch, n, state.vocab_size, device=device)
        lead = self.lead.shape[1]
        # Greedy's processed distribution is one-hot, which would leave every node a single
        # valid child: greedy trees take the draft's w most likely tokens by its own
        # distribution instead (they are drafted deterministically either way).
        shaping = SamplingParams(1.0) if state.sampling.greedy else state.sampling
        for level in levels:
            known = DraftTree(
                tokens[:, : level.scored],
                parents[:, : level.scored],
                valid=valid[:, : level.scored],
            )
            logits = self.draft.score_tree(self.cache, prepend_chain(self.lead, known))
            q = probabilities(
                logits[:, lead + level.frontier : lead + level.scored], shaping
            )  # [B, F, V]
            candidates, conditional, ok = self._children(
                q.flatten(0, 1), level.width, deterministic, state.generator
            )
            new, pick = slice(level.scored, level.end), level.pick.to(device)
            tokens[:, new] = candidates.view(batch, -1)[:, pick]
            valid[:, new] = ok.view(batch, -1)[:, pick] & valid[:, level.parent.to(device)]
            if q_all is not None:
                q_all[:, new] = conditional.view(batch, -1, q.shape[-1])[:, pick]
        self.budget = budget
        return DraftTree(
            tokens=tokens, parents=parents.contiguous(), draft_probs=q_all, valid=valid
        )

    def _children(
        self, q: Tensor, width: int, deterministic: bool, generator: torch.Generator | None
    ) -> tuple[Tensor, Tensor | None, Tensor]:
        """q [R, V] -> candidate tokens [R, W], the distributions they were drawn from
        [R, W, V] (None when deterministic) and validity [R, W] (False: no mass left)."""
        if deterministic:
            values, tokens = q.topk(width, dim=-1)
            return tokens, None, values > 0
        if self.children == "sample":
            return sample_without_replacement(q, width, generator)
        tokens = torch.stack([sample(q, generator) for _ in range(width)], dim=1)
        return tokens, q[:, None].expand(-1, width, -1), torch.ones_like(tokens, dtype=torch.bool)

    def observe(self, state: DecodeState, acceptance: Acceptance) -> None:
        roots = state.tree.tokens[:, :1]
        if not state.speculated:
            # The draft saw nothing this step: the target's root joins the uncached lead.
            self.lead = torch.cat([self.lead, roots], dim=1)
            return
        lead = self.lead.shape[1]
        counts = state.counts
        # Commit the lead and the kept nodes but the last: at most budget nodes, all scored by
        # the last draft pass (depth < budget).
        path = acceptance.path[:, : self.budget]
        nodes = torch.cat(
            [torch.arange(lead, device=path.device).expand(len(counts), lead), path + lead], dim=1
        )
        self.draft.commit(self.cache, nodes, torch.where(counts > 0, lead + counts - 1, 0))
        last = acceptance.path.gather(1, (counts - 1).clamp_min(0)[:, None])
        self.lead = torch.where(counts[:, None] > 0, state.tree.tokens.gather(1, last), roots)


def layer_skip_copy(model: object, n_layers: int) -> object:
    """The first n_layers of a native Llama with its embeddings, final norm and head, sharing
    the target's weight tensors: a draft costing about n_layers / L of a target forward (early
    exit). The only same-tokenizer draft SmolLM2 has here, besides trained heads."""
    from dataclasses import replace

    from genrec_spec.models.llm.llama import Llama

    state = {
        name: weight
        for name, weight in model.state_dict().items()
        if not name.startswith("layers.") or int(name.split(".")[1]) < n_layers
    }
    config = replace(model.config, n_layers=n_layers)
    return Llama.from_state_dict(config, state, dtype=model.tok_embeddings.weight.dtype)
