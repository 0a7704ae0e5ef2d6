"""EAGLE drafting: a one-layer feature drafter (``models.llm.eagle_drafter``) drafts level by level
from the target's features of the committed text; EAGLE-1 fills a static tree, EAGLE-2 grows a
dynamic one.

Keeping the drafter in step with the target. The drafter's KV cache holds only pairs
(f_t, x_{t+1}) whose feature is the target's own (hidden layer ``hidden_layer``, the LM head's
input; EAGLE-3: the fusion of the layers ``hidden_layer`` = (low, mid, high)); pairs with
predicted features (the draft tree) are never committed.
- ``begin``: the prompt's pairs t = 0 .. L - 2 come from the prefill's hidden states; one pass,
  committed row by row (rows have their own prompt lengths).
- ``observe``: after a step, row b emitted counts[b] tokens: the accepted nodes a_1 .. a_n and
  the next token y. The target scored the kept path (root, a_1 .. a_n), so its features pair
  with the emitted tokens (a_1 .. a_n, y): n + 1 new real pairs per row. One chain pass over the
  widest row's pairs, committing counts[b] of them per row, whatever each row accepted; finished
  rows commit nothing. Steps that did not speculate go through the same path (one pair).
- In both, the drafter's output at a row's last new pair is the predicted feature of its root
  (the token not yet scored), from which the next draft starts. A row whose prompt is a single
  token has no pair yet, so it drafts nothing on its first step.

Drafting (``propose``): the root's children are the drafter's top tokens after the root
feature. Each further level runs the drafter once over every node expanded so far (a tree hung
under the committed pairs: each node sees them and its own ancestors; a node's input feature is
its parent's predicted feature) and takes the top tokens after the newly expanded nodes. A pass
recomputes the earlier levels' nodes rather than keeping their K/V (the cache holds one pending
pass): on a CPU the layer is bound by reading its weights, so 4 or 40 nodes cost about the same.
One level (decoder pass + LM head + top-k) costs a small share of a target forward; the LM
head dominates it, hence the reduced draft vocabulary.

- ``EagleProposer`` (EAGLE-1): a static tree of rank paths (Medusa's choices); unlike Medusa, a
  node's children are the top tokens after *that node*.
- ``Eagle2Proposer`` (EAGLE-2): a dynamic tree. Every level expands the ``top_k`` candidates of
  the previous level with the highest cumulative draft log-probability, each into its
  ``top_k`` best children; finally the ``tree_nodes`` candidates with the highest cumulative
  log-probability over all levels form the tree (``tree.top_m_tree``), parents before children.

Drafts are deterministic functions of the committed text (``draft_probs`` None): greedy matching
and rejection sampling stay lossless.
"""

from __future__ import annotations

import torch
from torch import Tensor

from genrec_spec.core.tree import likely_choices, static_levels, static_tree, top_m_tree
from genrec_spec.core.types import Acceptance, DecodeInputError, DecodeState, DraftTree
from genrec_spec.llm.proposers.medusa import MC_SIM_7B_63
from genrec_spec.models.llm.eagle_drafter import EagleDrafter


class _FeatureDrafting:
    """What both trees share: the drafter's cache kept in step with the target, the root's
    predicted feature, and one drafting pass over a tree of expanded nodes."""

    k: int  # deepest draft
    max_pass: int  # most nodes one drafting pass runs over

    def __init__(
        self, drafter: EagleDrafter, hidden_layer: int | tuple[int, ...], draft_cost: float
    ) -> None:
        self.drafter = drafter
        # EAGLE-3's drafter reads several layers (low, mid, high), fused in this order.
        self.hidden_layers = (
            (hidden_layer,) if isinstance(hidden_layer, int) else tuple(hidden_layer)
        )
        self.draft_cost = draft_cost

    def _features(self, hidden: dict[int, Tensor]) -> Tensor:  # [B, N, D] the f_t (fused)
        """The drafter's input features from the target's hidden states ([B, N, D] each)."""
        if len(self.hidden_layers) == 1:  # EAGLE-1/2: the layer itself (fuse is the identity)
            return hidden[self.hidden_layers[0]]
        return self.drafter.fuse(torch.cat([hidden[i] for i in self.hidden_layers], dim=-1))

    def _check_width(self, width: int) -> None:
        vocab = len(self.drafter.vocab_ids)
        if width > vocab:
            raise DecodeInputError(
                f"the tree asks for {width} children of a node but the draft vocabulary has "
                f"{vocab} tokens",
                "use a narrower tree or a drafter with a larger draft vocabulary",
            )

    def begin(self, state: DecodeState) -> None:
        batch, device = state.batch_size, state.tokens.device
        config = self.drafter.config
        room = state.tokens.shape[1] + max(self.max_pass, self.k + 1)
        self.cache = self.drafter.new_cache(batch, min(room, config.max_seq_len))
        self.root_feature = self.drafter.fc.weight.new_zeros(batch, config.dim)  # [B, D]
        self.ready = torch.zeros(batch, dtype=torch.bool, device=device)  # [B] has a feature
        # [B, W, D]: the prompt minus its root; absent when every prompt is a single token
        if self.hidden_layers[0] in state.cache.hidden:
            features = self._features(state.cache.hidden)
            width = features.shape[1]
            self._advance(features, state.tokens[:, 1 : width + 1], state.prompt_lengths - 1)

    def observe(self, state: DecodeState, acceptance: Acceptance) -> None:
        self._advance(*self._kept_pairs(state, acceptance), state.counts)

    def _kept_pairs(
        self, state: DecodeState, acceptance: Acceptance
    ) -> tuple[Tensor, Tensor]:  # features [B, M, D], tokens [B, M] int64
        """The step's new pairs: the target's features along each row's kept path (root,
        a_1 .. a_n) and the tokens emitted after them (a_1 .. a_n, y)."""
        hidden = self._features(state.cache.hidden)  # [B, N, D] of the scored tree
        width = min(hidden.shape[1], self.k + 1)  # tokens a row emitted, at most
        path = acceptance.path[:, :width]  # [B, M] root, a_1 .. a_n
        features = hidden.gather(1, path[:, :, None].expand(-1, -1, hidden.shape[2]))
        return features, acceptance.tokens[:, :width]

    def _advance(
        self,
        features: Tensor,  # [B, M, D] the target's features f_t
        tokens: Tensor,  # [B, M] int64 the tokens x_{t+1} after them
        counts: Tensor,  # [B] int64 real pairs per row (a prefix; the rest is padding)
    ) -> None:
        """Commit each row's real pairs; its last output becomes its root feature."""
        batch, width = tokens.shape
        out = self.drafter(features, tokens, self.cache)  # [B, M, D]
        self.cache.commit(torch.arange(width, device=tokens.device).expand(batch, width), counts)
        last = (counts - 1).clamp_min(0)[:, None, None].expand(-1, 1, out.shape[2])
        fed = counts > 0  # [B]
        self.root_feature = torch.where(fed[:, None], out.gather(1, last)[:, 0], self.root_feature)
        self.ready = self.ready | fed

    def _draft_pass(
        self,
        tokens: Tensor,  # [B, E] int64 expanded nodes (the root excluded)
        parents: Tensor,  # [B, E] int64 their parents among them, -1 = the root
        features: Tensor,  # [B, E, D] their input features (their parents' predicted ones)
    ) -> Tensor:  # [B, E, D] their predicted features
        """One drafter pass over the expanded nodes; its K/V stay pending, never committed."""
        return self.drafter(features, tokens, self.cache, parents)

    def _valid(self, n: int) -> Tensor:  # [B, N] bool: rows without a root feature draft nothing
        valid = self.ready[:, None].expand(-1, n).clone()
        valid[:, 0] = True
        return valid


class EagleProposer(_FeatureDrafting):
    def __init__(
        self,
        drafter: EagleDrafter,
        hidden_layer: int,
        choices: list[tuple[int, ...]] | None = None,
        rank_acceptance: list[float] | None = None,
        tree_nodes: int = 12,
        max_depth: int = 6,
        draft_cost: float = 0.09,
    ) -> None:
        """EAGLE-1. drafter: a trained feature drafter; hidden_layer: the target layer it reads
        (``n_layers`` for the native Llama: the final-normed state); choices: the static tree
        (rank paths). Without choices: the ``tree_nodes`` paths most likely accepted under the
        drafter's held-out ``rank_acceptance`` (``tree.likely_choices``, at most ``max_depth``
        deep), or, without that either, the first ``tree_nodes`` paths of Medusa's MC_SIM_7B_63
        (EAGLE-1's tree). Small trees: a CPU target pays for every scored node. draft_cost: one
        draft level's cost relative to a target forward (for the controller, the step's feeding
        pass spread over the levels)."""
        super().__init__(drafter, hidden_layer, draft_cost)
        if choices is None:
            choices = (
                list(MC_SIM_7B_63[:tree_nodes])
                if rank_acceptance is None
                else likely_choices(rank_acceptance, tree_nodes, max_depth)
            )
        if not choices:
            raise DecodeInputError(
                "the static tree has no draft node (every rank's acceptance is 0?)",
                "pass choices, or rank_acceptance with a positive entry",
            )
        self.parents, ranks, depth = static_tree(choices)  # [N] each, breadth-first
        self.levels = static_levels(self.parents, ranks, depth)
        self.k = len(self.levels)
        self.max_pass = len(self.parents) - 1
        self._check_width(max(level.width for level in self.levels))

    def propose(self, state: DecodeState, budget: int) -> DraftTree:
        batch, device = state.batch_size, state.tokens.device
        levels = self.levels[:budget]
        n = levels[-1].end
        parents = self.parents[:n].to(device).expand(batch, n)
        tokens = state.tokens.new_zeros(batch, n)
        tokens[:, 0] = state.roots
        inputs = self.root_feature.new_zeros(batch, n, self.root_feature.shape[1])  # [B, N, D]
        for level in levels:
            if level.frontier == 0:  # the root's children
                predicted = self.root_feature[:, None]  # [B, 1, D]
            else:  # nodes 1 .. scored - 1 are drafter rows 0 .. scored - 2
                out = self._draft_pass(
                    tokens[:, 1 : level.scored],
                    parents[:, 1 : level.scored] - 1,
                    inputs[:, 1 : level.scored],
                )
                predicted = out[:, level.frontier - 1 :]  # [B, F, D] the frontier's features
            _, top = self.drafter.top_tokens(predicted, level.width)  # [B, F, W]
            new = slice(level.scored, level.end)
            tokens[:, new] = top.flatten(1)[:, level.pick.to(device)]
            inputs[:, new] = predicted[:, level.parent.to(device) - level.frontier]
        return DraftTree(tokens=tokens, parents=parents.contiguous(), valid=self._valid(n))


class Eagle2Proposer(_FeatureDrafting):
    def __init__(
        self,
        drafter: EagleDrafter,
        hidden_layer: int | tuple[int, ...],
        depth: int = 6,
        top_k: int = 4,
        tree_nodes: int = 12,
        draft_cost: float = 0.09,
    ) -> None:
        """EAGLE-2. depth: the deepest draft level (depth - 1 drafter passes a step); top_k:
        nodes expanded per level and children per expanded node; tree_nodes: draft nodes kept
        after the rerank (the tree scores 1 + tree_nodes tokens; EAGLE-2 keeps 60 on a GPU, a
        CPU target pays for each); draft_cost as for ``EagleProposer``. With an EAGLE-3
        drafter (``fused`` layers), hidden_layer is the tuple of the layers it fuses."""
        if depth < 1 or top_k < 1 or tree_nodes < 1:
            raise DecodeInputError(
                f"depth={depth}, top_k={top_k}, tree_nodes={tree_nodes}",
                "use depth, top_k and tree_nodes >= 1",
            )
        super().__init__(drafter, hidden_layer, draft_cost)
        self.k, self.top_k, self.tree_nodes = depth, top_k, tree_nodes
        self.max_pass = top_k * (depth - 1)
        self._check_width(top_k)

    def propose(self, state: DecodeState, budget: int) -> DraftTree:
        batch, device, k = state.batch_size, state.tokens.device, self.top_k
        log_probs, tokens = self.drafter.top_tokens(self.root_feature[:, None], k)  # [B, 1, k]
        # Candidates, level by level: token, cumulative log-probability, parent candidate.
        cand_tokens, cand_scores = [tokens[:, 0]], [log_probs[:, 0]]  # [B, C_level] each
        cand_parents = [torch.full_like(tokens[:, 0], -1)]
        # The level's candidates' input features: rows of `source` picked by `source_row`.
        source, source_row = self.root_feature[:, None], torch.zeros_like(tokens[:, 0])
        slot_of_parent = torch.full_like(tokens[:, 0], -1)  # [B, C_level] expanded slot
        expanded = tokens.new_zeros(batch, 0)  # [B, E] tokens of the expanded nodes
        expanded_parents = tokens.new_zeros(batch, 0)  # [B, E] their parents' slots, -1 = root
        expanded_inputs = source.new_zeros(batch, 0, source.shape[2])  # [B, E, D]
        offset = 0  # candidate index of the level's first candidate
        for _ in range(1, min(budget, self.k)):
            best = cand_scores[-1].topk(k, dim=1).indices  # [B, k] the level's nodes to expand
            expanded = torch.cat([expanded, cand_tokens[-1].gather(1, best)], dim=1)
            expanded_parents = torch.cat([expanded_parents, slot_of_parent.gather(1, best)], 1)
            rows = source_row.gather(1, best)[:, :, None].expand(-1, -1, source.shape[2])
            expanded_inputs = torch.cat([expanded_inputs, source.gather(1, rows)], dim=1)
            predicted = self._draft_pass(expanded, expanded_parents, expanded_inputs)[:, -k:]
            log_probs, tokens = self.drafter.top_tokens(predicted, k)  # [B, k, k]
            parent_scores = cand_scores[-1].gather(1, best)  # [B, k]
            # Strictly below the parent even where a log-probability rounds to 0, so the
            # rerank keeps every kept node's parent.
            below = torch.nextafter(parent_scores, parent_scores.new_tensor(float("-inf")))
            scores = torch.minimum(parent_scores[:, :, None] + log_probs, below[:, :, None])
            cand_parents.append((offset + best).repeat_interleave(k, dim=1))
            offset += cand_scores[-1].shape[1]
            cand_tokens.append(tokens.flatten(1))
            cand_scores.append(scores.flatten(1))
            width = expanded.shape[1]
            slots = torch.arange(width - k, width, device=device)  # the nodes just expanded
            slot_of_parent = slots.repeat_interleave(k).expand(batch, -1)
            source, source_row = predicted, torch.arange(k, device=device).repeat_interleave(k)
            source_row = source_row.expand(batch, -1)
        tree = top_m_tree(
            state.roots,
            torch.cat(cand_tokens, dim=1),
            torch.cat(cand_scores, dim=1),
            torch.cat(cand_parents, dim=1),
            self.tree_nodes,
        )
        return DraftTree(tree.tokens, tree.parents, valid=self._valid(tree.num_nodes))
