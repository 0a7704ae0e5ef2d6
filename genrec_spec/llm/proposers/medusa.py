"""Medusa drafting: K trained heads read the target's last hidden state once per step and fill a
static tree (Medusa's choices: rank paths) with each head's top tokens.

Which hidden state: the tree's root is the token the target emitted last step (the recovered or
bonus token), predicted by the target's LM head from the hidden state of the last *kept* node
of the scored tree. That state is what head k reads to predict the token k places below the
root: after a step it is ``cache.hidden[layer][b, path[b, num_accepted[b]]]``, row by row, so
rows that kept different path lengths each read their own node. After prefill (``begin``) it is
the prompt's last token before the root, at position ``prompt_length - 2`` of the prefill's
hidden states; a row whose prompt is a single token has no such state, so it drafts nothing on
its first step.

A node at depth d with sibling rank r gets head d's r-th most likely token, whatever its
ancestors are (Medusa-1: the heads see only the root's state). The draft is a deterministic
function of the committed text (``draft_probs`` None), so greedy matching and rejection
sampling stay lossless; typical acceptance (lossy) is the rule Medusa pairs it with.
"""

from __future__ import annotations

import torch
from torch import Tensor

from genrec_spec.core.tree import static_tree
from genrec_spec.core.types import Acceptance, DecodeInputError, DecodeState, DraftTree
from genrec_spec.models.llm.medusa_heads import MedusaHeads

# Medusa's mc_sim_7b_63 (FasterDecoding/Medusa, medusa/model/medusa_choices.py): rank paths
# ordered by how much each adds to the expected accepted length, so every prefix of the list
# is itself a tree (each path's parent path comes earlier).
MC_SIM_7B_63: tuple[tuple[int, ...], ...] = (
    (0,), (0, 0), (1,), (0, 1), (2,), (0, 0, 0), (1, 0), (0, 2), (3,), (0, 3), (4,), (0, 4),
    (2, 0), (0, 5), (0, 0, 1), (5,), (0, 6), (6,), (0, 7), (0, 1, 0), (1, 1), (7,), (0, 8),
    (0, 0, 2), (3, 0), (0, 9), (8,), (9,), (1, 0, 0), (0, 2, 0), (1, 2), (0, 0, 3), (4, 0),
    (2, 1), (0, 0, 4), (0, 0, 5), (0, 0, 0, 0), (0, 1, 1), (0, 0, 6), (0, 3, 0), (5, 0), (1, 3),
    (0, 0, 7), (0, 0, 8), (0, 0, 9), (6, 0), (0, 4, 0), (1, 4), (7, 0), (0, 1, 2), (2, 0, 0),
    (3, 1), (2, 2), (8, 0), (0, 5, 0), (1, 5), (1, 0, 1), (0, 2, 1), (9, 0), (0, 6, 0),
    (0, 0, 0, 1), (1, 6), (0, 7, 0),
)  # fmt: skip


class MedusaProposer:
    def __init__(
        self,
        heads: MedusaHeads,
        hidden_layer: int,
        choices: list[tuple[int, ...]] | None = None,
        tree_nodes: int = 24,
        draft_cost: float = 0.05,
    ) -> None:
        """heads: trained Medusa heads; hidden_layer: the target layer they read (the LM head's
        input: ``n_layers`` for the native Llama); choices: the static tree (rank paths), by
        default the first ``tree_nodes`` paths of MC_SIM_7B_63 (a small tree: a CPU target
        pays for every scored node); paths deeper than the number of heads are dropped.
        draft_cost: one draft level's cost relative to a target forward (all heads run in one
        pass, which at batch 1 mostly reads the LM head once, spread over the tree's levels).
        Works with any target that
        exposes hidden states (NativeTarget, HFTarget: layer n_layers is the final-normed
        state in both)."""
        choices = list(MC_SIM_7B_63[:tree_nodes] if choices is None else choices)
        choices = [c for c in choices if len(c) <= heads.num_heads]
        if not choices:
            raise DecodeInputError(
                f"no tree path fits {heads.num_heads} heads",
                "pass choices with paths of at most num_heads ranks, or tree_nodes >= 1",
            )
        self.heads = heads
        self.hidden_layers = (hidden_layer,)
        self.draft_cost = draft_cost
        self.parents, self.ranks, self.depth = static_tree(choices)  # [N] each, BFS order
        self.k = int(self.depth.max())

    def begin(self, state: DecodeState) -> None:
        # [B, W, D]: the prompt minus its root; absent when every prompt is a single token
        hidden = state.cache.hidden.get(self.hidden_layers[0])
        before_root = state.prompt_lengths - 2  # [B]
        self.ready = before_root >= 0  # [B] rows with a hidden state to draft from
        if hidden is None:
            hidden = self.heads.bias.new_zeros(state.batch_size, 1, self.heads.bias.shape[1])
        self.root_hidden = self._gather(hidden, before_root.clamp_min(0))  # [B, D]

    @staticmethod
    def _gather(hidden: Tensor, index: Tensor) -> Tensor:  # [B, N, D], [B] -> [B, D]
        return hidden.gather(1, index[:, None, None].expand(-1, 1, hidden.shape[2])).squeeze(1)

    def propose(self, state: DecodeState, budget: int) -> DraftTree:
        batch, device = state.batch_size, state.tokens.device
        n = int((self.depth <= budget).sum())  # BFS order: the nodes within budget come first
        depth, ranks = self.depth[1:n].to(device), self.ranks[1:n].to(device)  # [N - 1] each
        deepest = int(self.depth[:n].max())
        logits = self.heads(self.root_hidden[:, None], deepest)[:, 0]  # [B, deepest, V]
        top = logits.topk(int(self.ranks[:n].max()) + 1, dim=-1).indices  # [B, deepest, W]
        drafts = top[:, depth - 1, ranks]  # [B, N - 1]
        valid = self.ready[:, None].expand(batch, n - 1)
        return DraftTree(
            tokens=torch.cat([state.roots[:, None], drafts], dim=1),
            parents=self.parents[:n].to(device).expand(batch, n).contiguous(),
            valid=torch.cat([valid.new_ones(batch, 1), valid], dim=1),
        )

    def observe(self, state: DecodeState, acceptance: Acceptance) -> None:
        hidden = state.cache.hidden[self.hidden_layers[0]]  # [B, N, D] of the scored tree
        last = acceptance.path.gather(1, acceptance.num_accepted[:, None]).squeeze(1)  # [B]
        self.root_hidden = self._gather(hidden, last)
        self.ready = torch.ones_like(self.ready)
