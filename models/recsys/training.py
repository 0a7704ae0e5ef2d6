"""The recommender's training forward: the losses of one batch of training trees.

`forward_train` runs each user's `layout.train_layout` tree (history tokens, then a code branch
at sampled positions) through the same blocks as inference with the same tree mask, through
PyTorch's scaled-dot-product attention, which has a backward pass; the tests check that its
losses equal `encode_history` + `score_tree` on every prefix. Then the losses of the code levels,
the item objective and the heads.

`TrainingForward` is a part of `SemanticIdRecommender` (a mixin).

Shape letters: B users, T history tokens, P code branches per row, L code levels, N tokens of
the pass, R real history positions, M head training states, D model width, I items.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from genrec_spec.models.recsys.errors import RecommenderInputError
from genrec_spec.models.recsys.layout import TrainLayout


@dataclass(frozen=True)
class TrainStates:
    """What the training pass leaves for the losses."""

    states: Tensor  # [R, D] the state at every real history position
    state_items: Tensor  # [R] the item each of them predicts
    state_level0: Tensor  # [R] that item's level-0 code
    node_h: Tensor  # [B, P, L-1, D] the code branches' node states
    anchor_h: Tensor  # [B, P, D] each branch's history state (at its anchor)
    branch_codes: Tensor  # [B, P, L] the codes each branch spells (its anchor's next item)
    branch_items: Tensor  # [B, P] that item
    has_branch: Tensor  # [B, P] bool, False for padding branches


class TrainingForward:
    """The training losses of `SemanticIdRecommender` (module docstring)."""

    def forward(self, layout: TrainLayout) -> dict[str, Tensor]:
        """`forward_train`; DistributedDataParallel calls a module through `forward`."""
        return self.forward_train(layout)

    def forward_train(self, layout: TrainLayout) -> dict[str, Tensor]:
        """Losses of one batch (each a mean cross-entropy per predicted code or item; `loss` is
        the weighted total): `level_l` for the backbone's level l, `item`, `parallel`,
        `long_id`, `draft`."""
        out = self._train_pass(layout)
        losses: dict[str, Tensor] = {}
        if not self.config.level0_from_items:  # else the item objective trains level 0
            losses["level_0"] = F.cross_entropy(self.code_heads[0](out.states), out.state_level0)
        root_query = None  # [M', D] the branches' item query (tied residual), shared by levels
        if self.node_item_query is not None:
            root_query = self.item_query(out.anchor_h[out.has_branch])
        codes = out.branch_codes[out.has_branch]  # [M', L]
        for level in range(1, self.num_levels):
            node_h = out.node_h[:, :, level - 1][out.has_branch]  # [M', D]
            log_probs = self._level_log_probs(node_h, level, codes[:, :level], root_query)
            losses[f"level_{level}"] = F.nll_loss(log_probs, codes[:, level])
        total = sum(losses.values())
        objective = self.config.item_objective
        if objective is not None:
            losses["item"] = F.cross_entropy(self.item_scores(out.states), out.state_items)
            total = total + objective.weight * losses["item"]
        for name, (loss, weight) in self._head_losses(out).items():
            losses[name] = loss
            total = total + weight * loss
        losses["loss"] = total
        return losses

    def _train_pass(self, layout: TrainLayout) -> TrainStates:
        """Every user's training tree through the blocks, under its tree mask."""
        levels, tokens = self.num_levels, layout.num_history_tokens
        if tokens > self.config.max_len + 1:
            raise RecommenderInputError(
                f"training windows hold up to max_len + 1 = {self.config.max_len + 1} items, "
                f"got {tokens}",
                "cut windows to the model's max_len first (recsys.data.training_windows)",
            )
        batch, branches = layout.branch_anchor.shape
        next_codes = self.item_codes[layout.next_items.clamp(min=0)]  # [B, T, L]
        has_branch = layout.branch_anchor >= 0  # [B, P]
        anchor = layout.branch_anchor.clamp(min=0)
        branch_codes = next_codes.gather(1, anchor[..., None].expand(-1, -1, levels))  # [B, P, L]
        node_codes = branch_codes[:, :, :-1].reshape(batch, -1)  # [B, P*(L-1)]
        node_levels = torch.arange(levels - 1, device=node_codes.device).repeat(branches)
        node_levels = node_levels.expand(batch, -1)
        node_valid = has_branch.repeat_interleave(levels - 1, dim=1)
        hist, nodes = self._embed(
            layout.hist_items, layout.hist_offsets, node_codes, node_levels, node_valid
        )
        x = torch.cat([hist, nodes], dim=1)  # [B, T + P*(L-1), D]
        attend = self.attention_rule.layout(layout, x.dtype)  # built once for all layers
        for block in self.blocks:
            x = block(x, attend)
        h = self.norm(x)
        real = layout.next_items >= 0  # [B, T]
        return TrainStates(
            states=h[:, :tokens][real],
            state_items=layout.next_items[real],
            state_level0=next_codes[..., 0][real],
            node_h=h[:, tokens:].unflatten(1, (branches, levels - 1)),
            # Each branch's history state: the state at its anchor, whose next item it spells.
            anchor_h=h[:, :tokens].gather(1, anchor[..., None].expand(-1, -1, h.shape[-1])),
            branch_codes=branch_codes,
            branch_items=layout.next_items.gather(1, anchor),
            has_branch=has_branch,
        )

    def _head_losses(self, out: TrainStates) -> dict[str, tuple[Tensor, float]]:
        """name -> (loss, its weight) of the parallel, long-ID and draft heads the model has.

        The draft head learns from the history states at a stratified subset of the branch
        anchors, to bound its cost (per state: the item scores its tied logits read, a GRU step
        per level); the parallel and long-ID heads from the same states, or with a position
        stride from every n-th history position."""
        stride = max(1, out.has_branch.shape[1] // self.config.head_branches)
        head_rows = out.has_branch[:, ::stride]  # [B, P']
        anchor_h = out.anchor_h[:, ::stride][head_rows]  # [M, D] the subset's states
        target_codes = out.branch_codes[:, ::stride][head_rows]  # [M, L]
        target_items = out.branch_items[:, ::stride][head_rows]  # [M]
        states = out.states
        if self.config.detach_heads:
            anchor_h, states = anchor_h.detach(), states.detach()
        losses = {}
        code_heads = (  # (name, head, its config, its code table [I, J])
            ("parallel", self.parallel_heads, self.config.parallel_heads, self.item_codes),
            ("long_id", self.long_id_heads, self.config.long_id_heads, self.long_ids),
        )
        for name, head, config, table in code_heads:
            if head is None:
                continue
            code_h, code_items = anchor_h, target_items  # [M', D], [M']
            if config.position_stride:
                every = config.position_stride
                code_h, code_items = states[::every], out.state_items[::every]
            if config.item_loss:
                loss = head.catalogue_loss(code_h, table, code_items)
            else:
                loss = head.loss(code_h, table[code_items])
            losses[name] = (loss, config.weight)
        if self.draft_head is not None:
            item_logits = None  # per level [M, V]: what the tied head adds to its logits
            if self.config.draft_tied:
                # The tied head learns a correction on top of the item objective, held fixed
                # here: the draft loss trains the head, not the item table.
                with torch.no_grad():
                    scores = self.item_scores(anchor_h)  # [M, I]
                    item_logits = [
                        self.draft_item_logits(scores, target_codes[:, None, :level])[:, 0]
                        for level in range(1, self.num_levels)
                    ]
            loss = self.draft_head.loss(anchor_h, target_codes, item_logits)
            losses["draft"] = (loss, self.config.draft_head.weight)
        return losses

    def _embed(
        self,
        hist_items: Tensor,  # [M] int64
        hist_offsets: Tensor,  # [B+1] int64, every row <= max_len items
        node_codes: Tensor,  # [B, N] int64
        node_levels: Tensor,  # [B, N] int64 in 0..L-2
        node_valid: Tensor,  # [B, N] bool; invalid nodes get no code embedding
    ) -> tuple[Tensor, Tensor]:  # history tokens [B, T, D] (T = 1 + longest row), nodes [B, N, D]
        lengths = hist_offsets[1:] - hist_offsets[:-1]  # [B]
        hist_codes = self.item_codes[hist_items]  # [M, L]
        per_key, per_len = {}, {}
        for level in range(self.num_levels):
            per_key[f"code_{level}"], per_len[f"code_{level}"] = hist_codes[:, level], lengths
        per_key["item"], per_len["item"] = hist_items, lengths
        for level in range(self.num_levels - 1):
            chosen = node_valid & (node_levels == level)  # [B, N]
            per_key[f"node_code_{level}"] = node_codes[chosen]
            per_len[f"node_code_{level}"] = chosen.sum(dim=1)
        kjt = KeyedJaggedTensor(
            keys=self.feature_keys,
            values=torch.cat([per_key[k] for k in self.feature_keys]),
            lengths=torch.cat([per_len[k] for k in self.feature_keys]),
        )
        out = self.embeddings(kjt)

        item_sum = sum(out[f"code_{level}"].values() for level in range(self.num_levels))
        if self.config.has_item_table:
            item_sum = item_sum + out["item"].values()  # [M, D]
        hist = self._history_tokens(item_sum, hist_offsets)

        nodes = self.level_embedding(node_levels)  # [B, N, D]
        for level in range(self.num_levels - 1):
            chosen = node_valid & (node_levels == level)
            nodes = nodes.masked_scatter(chosen[..., None], out[f"node_code_{level}"].values())
        return self.embed_drop(hist), self.embed_drop(nodes)
