"""MTP drafting: DeepSeek-V3-style sequential modules (``models.llm.mtp_drafter``) draft from the
target's feature of the last scored position, module k giving the tokens at depth k. The trees
are EAGLE's (``proposers.eagle``): a static one from rank paths (default: a chain of K tokens)
or EAGLE-2's dynamic one; only what a drafting pass runs differs.

What each module's cache holds. The committed text is x_0 .. x_{L-1}, the root x_{L-1} not yet
scored, so the target's features f_i are known for i = 0 .. L - 2. Module k at position i reads
(h^{k-1}_i, x_{i+k}) (h^0 = f), so position i is committed once x_{i+k} is: module k's cache
holds its K/V at positions 0 .. L - 1 - k, every one computed from committed tokens and the
previous depth's committed states, i.e. exactly training's teacher-forced states (module 1's
are EAGLE's pairs (f_i, x_{i+1})). The proposer also keeps each module's frontier state: h^k at
its last committed position L - 1 - k. Draft states are never committed.

- ``begin``: the prompt (L from 0 to its length) through ``_commit``, module 1 reading the
  prefill's features.
- ``observe``: row b emitted counts[b] = n + 1 tokens (accepted a_1 .. a_n and the next token
  y), so L' = L + n + 1. Module k commits positions L - k .. L' - 1 - k (n + 1 of them; fewer
  near the start of the text, where positions would be < 0). Their inputs: the tokens x_{i+k}
  from the committed text, and h^{k-1}_i: module k - 1's old frontier (position L - k) followed
  by module k - 1's states of its own new positions, just computed. Module 1 reads the target's
  features along the kept path (root, a_1 .. a_n), as EAGLE's pairs. One chain pass per module,
  in depth order, each committing its rows' new positions whatever each row accepted; finished
  rows commit nothing. Only the tree's depth's first modules are kept in step (the deeper ones
  never draft): each module kept costs a pass every step. The accepted path's new entries are
  recomputed from real tokens and
  committed states, never copied from the draft (a module's draft pass covers only the depths
  below it).

Drafting. The root's children are module 1's top tokens after its frontier h^1_{L-2}. Level d
(d >= 1) runs module d + 1 once over every node expanded so far (depths 1 .. d, a tree hung
after its committed positions: a node at depth j sits at position L - d - 2 + j): the node's
input is its token and module d's state at its parent (for a depth-1 node, module d's frontier
at position L - 1 - d). Module d + 1's state at a depth-d node is h^{d+1}_{L-2} along that
node's path, and its top tokens are the node's children. Unlike EAGLE's passes, which rerun
one layer over the earlier levels, every module runs once per node it needs. A row drafts to
depth d only where module d - 1's frontier exists (L >= d) and module 1's does (L >= 2):
deeper nodes are marked invalid.

Drafts are deterministic functions of the committed text (``draft_probs`` None): greedy
matching and rejection sampling stay lossless.
"""

from __future__ import annotations

import torch
from torch import Tensor

from genrec_spec.core.tree import topology
from genrec_spec.core.types import Acceptance, DecodeInputError, DecodeState, DraftTree
from genrec_spec.llm.proposers.eagle import Eagle2Proposer, EagleProposer
from genrec_spec.models.llm.mtp_drafter import MTPDrafter

# The default chain's length. On a CPU every module kept in step costs a pass each step and
# every drafted token the target's verification, so short chains win there: the deeper
# modules' acceptance does not pay for their passes (docs/results/llm.md). Where verification
# is nearly free (a GPU), pass a deeper one.
CHAIN_DEPTH = 2


class _ModuleDrafting:
    """The MTP side of a feature-drafting proposer (mixed into EAGLE's trees): K caches and
    frontiers kept in step with the target, and drafting passes that run module d + 1 on module
    d's states."""

    drafter: MTPDrafter
    hidden_layers: tuple[int, ...]
    k: int
    max_pass: int

    def _check_depth(self) -> None:
        if self.k > self.drafter.depths:
            raise DecodeInputError(
                f"the tree is {self.k} deep but the drafter has {self.drafter.depths} modules",
                f"use a tree at most {self.drafter.depths} deep",
            )

    def begin(self, state: DecodeState) -> None:
        batch, config = state.batch_size, self.drafter.config
        room = min(state.tokens.shape[1] + max(self.max_pass, self.k + 1), config.max_seq_len)
        # Modules deeper than the tree never draft: only the first k are kept in step.
        self.caches = [self.drafter.new_cache(batch, room) for _ in range(self.k)]
        zeros = self.drafter.draft_head.new_zeros(batch, config.dim)
        self.frontiers = [zeros] * self.k  # [B, D] each: h^k at L - 1 - k
        self.root_feature = zeros
        self.ready = state.lengths >= 2  # [B] module 1 has a frontier
        # [B, W, D]: the prompt minus its root; absent when every prompt is a single token
        if self.hidden_layers[0] in state.cache.hidden:
            old = torch.zeros_like(state.lengths)
            self._commit(self._features(state.cache.hidden), state, old)

    def observe(self, state: DecodeState, acceptance: Acceptance) -> None:
        features, _ = self._kept_pairs(state, acceptance)
        self._commit(features, state, state.lengths - state.counts)

    def _commit(
        self,
        features: Tensor,  # [B, M, D] the target's f at module 1's new positions
        state: DecodeState,  # its tokens and lengths already hold the new text
        old: Tensor,  # [B] int64 committed text length before it
    ) -> None:
        """Every module's new positions, in depth order (module docstring)."""
        new, last_token = state.lengths, state.tokens.shape[1] - 1
        batch, width, dim = features.shape
        steps = torch.arange(width, device=features.device)
        source, skip = features, torch.zeros_like(old)  # module k's inputs: source[skip + j]
        for k, cache in enumerate(self.caches, 1):
            first = (old - k).clamp_min(0)  # [B] module k's first new position
            count = (new - k).clamp_min(0) - first  # [B] its new positions
            index = (skip[:, None] + steps).clamp_max(source.shape[1] - 1)[:, :, None]
            inputs = source.gather(1, index.expand(-1, -1, dim))  # [B, M, D]
            tokens = state.tokens.gather(1, (first[:, None] + k + steps).clamp_max(last_token))
            out = self.drafter(k, inputs, tokens, cache)  # [B, M, D]
            cache.commit(steps.expand(batch, width), count)
            # Module k + 1 reads module k's old frontier (position L - 1 - k), then its new
            # states; without an old frontier (L <= k) it starts at the new states.
            frontier = self.frontiers[k - 1]
            source, skip = torch.cat([frontier[:, None], out], dim=1), (old <= k).long()
            last = out.gather(1, (count - 1).clamp_min(0)[:, None, None].expand(-1, 1, dim))
            self.frontiers[k - 1] = torch.where((count > 0)[:, None], last[:, 0], frontier)
        self.root_feature = self.frontiers[0]
        self.ready = new >= 2

    def propose(self, state: DecodeState, budget: int) -> DraftTree:
        self._passes, self._states = 0, None
        tree = super().propose(state, budget)  # type: ignore[misc]
        _, depth = topology(tree.parents, validate=False)  # [B, N]
        reach = torch.where(state.lengths >= 2, state.lengths, 0)  # [B] deepest draft
        valid = tree.node_valid() & (depth <= reach[:, None])
        return DraftTree(tree.tokens, tree.parents, valid=valid)

    def _draft_pass(
        self,
        tokens: Tensor,  # [B, E] int64 expanded nodes (the root excluded), depths 1 .. d
        parents: Tensor,  # [B, E] int64 their parents among them, -1 = the root
        features: Tensor,  # [B, E, D] EAGLE's inputs, unused: module d reads module d - 1's
    ) -> Tensor:  # [B, E, D] module d + 1's states at the nodes
        """Module d + 1 over the nodes, each reading module d's state at its parent (the
        previous pass's, whose nodes are a prefix of these) or, under the root, module d's
        frontier. Its K/V stay pending, never committed."""
        depth = self._passes + 2
        frontier = self.frontiers[depth - 2][:, None]  # [B, 1, D]
        source = frontier if self._states is None else torch.cat([frontier, self._states], 1)
        index = (parents + 1)[:, :, None].expand(-1, -1, source.shape[2])
        out = self.drafter(depth, source.gather(1, index), tokens, self.caches[depth - 1], parents)
        self._passes, self._states = self._passes + 1, out
        return out


class MTPProposer(_ModuleDrafting, EagleProposer):
    def __init__(
        self,
        drafter: MTPDrafter,
        hidden_layer: int,
        choices: list[tuple[int, ...]] | None = None,
        depth: int | None = None,
        draft_cost: float = 0.1,
    ) -> None:
        """A static tree. drafter: trained MTP modules; hidden_layer: the target layer module 1
        reads (``n_layers`` for the native Llama: the final-normed state); choices: the tree's
        rank paths (at most ``drafter.depths`` deep), by default a chain of ``depth`` tokens
        (default: CHAIN_DEPTH, at most ``drafter.depths``). draft_cost: one draft level's cost
        relative to a target forward (for the controller: a module's pass and its reduced LM
        head)."""
        if choices is None:
            depth = min(CHAIN_DEPTH, drafter.depths) if depth is None else depth
            choices = [(0,) * d for d in range(1, depth + 1)]
        super().__init__(drafter, hidden_layer, choices=choices, draft_cost=draft_cost)
        self._check_depth()


class MTPTreeProposer(_ModuleDrafting, Eagle2Proposer):
    def __init__(
        self,
        drafter: MTPDrafter,
        hidden_layer: int,
        depth: int | None = None,
        top_k: int = 4,
        tree_nodes: int = 12,
        draft_cost: float = 0.1,
    ) -> None:
        """EAGLE-2's dynamic tree on MTP modules: depth (default ``drafter.depths``, at most
        that), top_k, tree_nodes and draft_cost as for ``Eagle2Proposer`` / ``MTPProposer``."""
        depth = drafter.depths if depth is None else depth
        super().__init__(drafter, hidden_layer, depth, top_k, tree_nodes, draft_cost)
        self._check_depth()
