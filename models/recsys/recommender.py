"""The Semantic-ID generative recommender: a decoder-only transformer over user histories that
decodes the next item's code tuple level by level.

Tokens. Each history item is ONE token: its item embedding + the sum of its code embeddings + a
learned position embedding (position 0 is a BOS token, so an empty history still has a state).
A code token (a node of a decoding tree) is the embedding of its code + a level embedding. All
embedding tables live in one torchrec `EmbeddingCollection` fed by one `KeyedJaggedTensor` per
forward (history keys `item`, `code_l`; tree-node keys `node_code_l` share the `code_l` tables),
so the tables can be sharded with torchrec when catalogues outgrow one machine.

Decoding. The last history token predicts code level 0; a code token of level l predicts level
l + 1 (output head l + 1). Code tokens see the whole history and their own ancestors, never
their siblings (see `rec_layout`). Inference:

    state = model.encode_history(values, offsets)   # one causal pass, K/V cached per layer
    log_probs = model.score_tree(state, codes, levels, parents)   # one tree-attention pass
    state, log_probs = model.encode_history_and_tree(values, offsets, codes, levels, parents)

`score_tree` is stateless with respect to the tree: the history cache is the shared root and
never grows (one item is predicted), so a decoder passes every prefix node it needs scored
(a beam's prefixes, a drafted trie) and nothing has to be committed. The third form fuses both
into one pass when the tree is known before the history is read (candidate scoring).

Training (`forward_train`) runs the `rec_layout.train_layout` tree of each user through the same
blocks with the same tree mask (`TrainLayout.visibility`, equal to the kernels'
`ancestor_mask` of its parents), through PyTorch's scaled-dot-product attention, which has a
backward pass (the op's differentiable reference backend rebuilds a dense mask in every layer
and measured ~10x slower); the tests check that it equals
`encode_history` + `score_tree`.

Shape letters: B users, M history items, T history tokens (BOS included), N tree nodes,
D model width, H heads, L code levels (collision code included), V codes, I items, Q digits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from genrec_spec.kernels import prepare_tree, tree_attention
from genrec_spec.models.derived import DerivedCache
from genrec_spec.models.recsys.config import RecommenderConfig
from genrec_spec.models.recsys.heads import (
    LongIdHeads,
    ParallelLevelHeads,
    RecurrentDraftHead,
    children_log_softmax,
)
from genrec_spec.models.recsys.item_prefixes import ItemPrefixIndex
from genrec_spec.models.recsys.layout import TrainLayout

_PREFIX_INDEXES = DerivedCache()  # item_codes table -> its items sorted by code tuple
_UNIT_ITEM_KEYS = DerivedCache()  # item embedding table -> its rows at unit length


class RecommenderInputError(ValueError):
    """Bad input to the recommender (ids out of range, malformed offsets or trees)."""


@dataclass
class HistoryState:
    """What `encode_history` leaves for `score_tree`: the per-layer K/V cache of the history."""

    keys: Tensor  # [layers, B, H, T, D/H]
    values: Tensor  # [layers, B, H, T, D/H]
    lengths: Tensor  # [B] int64 history tokens per row (BOS included): the root length
    hidden: Tensor  # [B, D] final hidden state of the last history token (input of the heads)
    level0_log_probs: Tensor  # [B, V0] log-probs of the next item's level-0 code
    truncated: Tensor  # [B] bool, True where the history was longer than max_len

    def rows(self, index: Tensor) -> HistoryState:  # index [b] int64 -> the state of b rows
        return HistoryState(
            keys=self.keys[:, index],
            values=self.values[:, index],
            lengths=self.lengths[index],
            hidden=self.hidden[index],
            level0_log_probs=self.level0_log_probs[index],
            truncated=self.truncated[index],
        )


class Block(nn.Module):
    """Pre-norm transformer block; attention itself is done by the caller (`attend`), which is
    what differs between training, prefill and tree scoring."""

    def __init__(self, config: RecommenderConfig) -> None:
        super().__init__()
        self.heads = config.heads
        self.norm1 = nn.LayerNorm(config.dim)
        self.qkv = nn.Linear(config.dim, 3 * config.dim)
        self.proj = nn.Linear(config.dim, config.dim)
        self.norm2 = nn.LayerNorm(config.dim)
        self.ffn = nn.Sequential(
            nn.Linear(config.dim, config.ffn_mult * config.dim),
            nn.GELU(),
            nn.Linear(config.ffn_mult * config.dim, config.dim),
        )
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: Tensor, attend, keep: Tensor | None = None) -> Tensor:
        """x: [B, N, D] -> [B, N, D]. With `keep` ([B, N'] token indices) -> [B, N', D]: only
        those tokens' outputs, their queries attending over every token's keys and values (a
        last block whose other outputs nobody reads)."""
        q, k, v = self.qkv(self.norm1(x)).unflatten(-1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4)
        if keep is not None:
            x = x.gather(1, keep[..., None].expand(-1, -1, x.shape[-1]))
            q = q.gather(2, keep[:, None, :, None].expand(-1, q.shape[1], -1, q.shape[-1]))
        out = attend(q, k, v).transpose(1, 2).flatten(2)  # [B, H, N, Dh] -> [B, N, D]
        x = x + self.drop(self.proj(out))
        return x + self.drop(self.ffn(self.norm2(x)))


class SemanticIdRecommender(nn.Module):
    def __init__(
        self,
        config: RecommenderConfig,
        item_codes: Tensor,  # [I, L] int64 Semantic ID of every item (collision code last)
        codebook_sizes: list[int],  # [L] codes per level
        long_ids: Tensor | None = None,  # [I, Q] int64 long PQ IDs (RPG), None = no long IDs
        long_id_sizes: list[int] | None = None,  # [Q] codes per digit
    ) -> None:
        super().__init__()
        if config.dim % config.heads:
            raise RecommenderInputError(
                f"dim {config.dim} is not divisible by heads {config.heads}"
            )
        if (
            item_codes.dim() != 2
            or item_codes.shape[1] != len(codebook_sizes)
            or len(codebook_sizes) < 2
        ):
            raise RecommenderInputError(
                f"item_codes {tuple(item_codes.shape)} must be [items, L] with L = "
                f"len(codebook_sizes) = {len(codebook_sizes)} >= 2 levels"
            )
        self.config = config
        self.codebook_sizes = [int(v) for v in codebook_sizes]
        self.register_buffer("item_codes", item_codes.long(), persistent=True)
        self.long_id_sizes = [int(v) for v in long_id_sizes] if long_ids is not None else None
        self.register_buffer("long_ids", None if long_ids is None else long_ids.long())
        levels, dim = self.num_levels, config.dim

        tables = [
            EmbeddingConfig(
                name=f"t_code_{level}",
                embedding_dim=dim,
                num_embeddings=size,
                # Level-L-1 codes (collision) only ever appear in histories, never as nodes.
                feature_names=[f"code_{level}"] + ([f"node_code_{level}"] * (level < levels - 1)),
            )
            for level, size in enumerate(self.codebook_sizes)
        ]
        if config.has_item_table:
            tables.append(
                EmbeddingConfig(
                    name="t_item",
                    embedding_dim=dim,
                    num_embeddings=self.num_items,
                    feature_names=["item"],
                )
            )
        self.embeddings = EmbeddingCollection(tables=tables, device=item_codes.device)
        self.feature_keys = [name for table in tables for name in table.feature_names]
        self.bos = nn.Parameter(torch.zeros(dim))
        self.positions = nn.Embedding(config.max_len + 1, dim)
        self.level_embedding = nn.Embedding(levels - 1, dim)
        self.embed_drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.norm = nn.LayerNorm(dim)
        # code_heads[l] predicts level l (from the last history token for l = 0). Tying them to
        # the code embedding tables measured worse on ML-100K (valid HR@10 0.070 vs 0.085).
        # With level0_from_items level 0 has no head of its own (`level0_logits`); with
        # tied levels the heads of levels 1.. add to the item objective's child logits.
        self.code_heads = nn.ModuleList(
            nn.Identity() if level == 0 and config.level0_from_items else nn.Linear(dim, v)
            for level, v in enumerate(self.codebook_sizes)
        )
        self.parallel_heads = (
            ParallelLevelHeads(dim, self.codebook_sizes) if config.parallel_heads else None
        )
        self.long_id_heads = (
            LongIdHeads(dim, self.long_id_sizes)
            if config.long_id_heads and long_ids is not None
            else None
        )
        self.draft_head = (
            RecurrentDraftHead(dim, self.codebook_sizes, config.draft_head.hidden)
            if config.draft_head
            else None
        )
        # Maps a prefix node's state to its correction of the history state's item query.
        residual = config.tied_levels is not None and config.tied_levels.residual
        self.node_item_query = nn.Linear(dim, dim, bias=False) if residual else None
        self._init_weights()
        if self.node_item_query is not None:  # the levels start as the item softmax's
            nn.init.zeros_(self.node_item_query.weight)
        if config.draft_tied:  # so does the draft head
            for out in self.draft_head.out:
                nn.init.zeros_(out.weight)

    def _init_weights(self) -> None:
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    @property
    def num_items(self) -> int:
        return self.item_codes.shape[0]

    @property
    def num_levels(self) -> int:  # L
        return len(self.codebook_sizes)

    @property
    def forced_codes_free(self) -> bool:
        """True when the code levels are normalised over each prefix's children only
        (tied levels): a prefix with one child gives it log-prob exactly 0, so a decoder
        need not score it. On ML-1M 81% of the length-2 prefixes and 95% of the length-3 ones
        have one child (beam at W = 20 meets ~8 and ~2 of 20 with a choice)."""
        return self.config.tied_levels is not None

    @property
    def item_objective(self):  # -> ItemObjectiveConfig | None
        """The item objective's config; None for a model trained without it."""
        return self.config.item_objective

    def item_scores(self, hidden: Tensor) -> Tensor:
        """hidden [B, D] (a HistoryState's) -> [B, I] SASRec-style next-item logits."""
        return self._item_query(hidden) @ self._item_table().T

    def _item_query(self, hidden: Tensor) -> Tensor:  # [..., D]
        """The state's side of an item logit: itself, or unit length over the temperature."""
        temperature = self.config.item_objective.temperature
        return F.normalize(hidden, dim=-1) / temperature if temperature else hidden

    def _item_table(self) -> Tensor:  # [I, D]
        """Every item's side of an item logit: its embedding row, or with a temperature the
        row at unit length, normalised once per weight version outside autograd (a decode
        calls it once per level pass)."""
        table = self.embeddings.embeddings["t_item"].weight
        if not self.config.item_objective.temperature:
            return table
        if torch.is_grad_enabled():  # training: the keys carry the gradient to the table
            return F.normalize(table, dim=-1)
        return _UNIT_ITEM_KEYS.get(table, (table,), lambda: F.normalize(table, dim=-1))

    def level0_logits(self, hidden: Tensor) -> Tensor:
        """hidden [N, D] -> [N, V0] logits of the next item's level-0 code: its code head's, or
        with level0_from_items the item logits' log-sum-exp over each level-0 cluster. A code
        no item has gets -inf."""
        if not self.config.level0_from_items:
            return self.code_heads[0](hidden)
        item_logits = self.item_scores(hidden)  # [N, I]
        top = item_logits.max(dim=-1, keepdim=True).values.detach()  # [N, 1] for stability
        mass = item_logits.new_zeros(item_logits.shape[0], self.codebook_sizes[0])
        mass = mass.index_add(1, self.item_codes[:, 0], (item_logits - top).exp())
        return mass.log() + top

    def backbone_parameters(self) -> list[nn.Parameter]:
        """Everything but the draft heads (what `freeze_backbone` freezes)."""
        heads = {id(p) for m in self.draft_heads() for p in m.parameters()}
        return [p for p in self.parameters() if id(p) not in heads]

    def draft_heads(self) -> list[nn.Module]:
        return [m for m in (self.parallel_heads, self.long_id_heads, self.draft_head) if m]

    # ----------------------------------------------------------------------------- embedding

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

    def _history_tokens(self, item_sum: Tensor, offsets: Tensor) -> Tensor:
        """Summed item embeddings [M, D] of B rows (offsets [B+1]) -> tokens [B, T, D]: BOS,
        the items, right padding (copies of BOS), plus position embeddings."""
        batch = offsets.numel() - 1
        lengths = offsets[1:] - offsets[:-1]  # [B]
        tokens = 1 + (int(lengths.max()) if batch else 0)
        hist = self.bos.expand(batch, tokens, self.config.dim).clone()  # BOS at position 0
        # A row-major boolean index visits the items in `item_sum`'s order.
        real = torch.arange(tokens - 1, device=lengths.device) < lengths[:, None]  # [B, T-1]
        hist[:, 1:][real] = item_sum
        return hist + self.positions.weight[:tokens]

    def _check_history(self, values: Tensor, offsets: Tensor) -> None:
        if values.dim() != 1 or values.is_floating_point():
            raise RecommenderInputError(
                f"history values must be a 1-D integer tensor [M], got {tuple(values.shape)} "
                f"{values.dtype}"
            )
        if (
            offsets.dim() != 1
            or offsets.numel() < 2
            or int(offsets[0]) != 0
            or int(offsets[-1]) != values.numel()
            or bool((offsets[1:] < offsets[:-1]).any())
        ):
            raise RecommenderInputError(
                "history offsets must be non-decreasing, of length B+1 >= 2, start at 0 and end "
                f"at M = {values.numel()}; got {offsets.tolist()[:8]}..."
            )
        if values.numel() and (int(values.min()) < 0 or int(values.max()) >= self.num_items):
            raise RecommenderInputError(
                f"history item indices must lie in [0, {self.num_items}); map raw item ids to "
                "item indices (items.parquet item_index) first"
            )

    # ----------------------------------------------------------------------------- inference
    # Inference reads the EmbeddingCollection's tables directly instead of through a
    # KeyedJaggedTensor: the KJT's bookkeeping and `_embed`'s per-level node loop took ~0.5 ms of
    # a ~1.4 ms batch-1 history pass (ML-100K model, 1 thread). Same tables, same sums.

    def _item_sums(self, values: Tensor) -> Tensor:
        """values [M] -> [M, D]: each item's code embeddings summed (+ its item embedding)."""
        tables = self.embeddings.embeddings
        codes = self.item_codes[values]  # [M, L]
        item_sum = sum(tables[f"t_code_{lv}"](codes[:, lv]) for lv in range(self.num_levels))
        if self.config.has_item_table:
            item_sum = item_sum + tables["t_item"](values)
        return item_sum

    def _embed_history(self, values: Tensor, offsets: Tensor) -> Tensor:
        """values [M], offsets [B+1] (rows <= max_len) -> history tokens [B, T, D]."""
        return self.embed_drop(self._history_tokens(self._item_sums(values), offsets))

    def _embed_nodes(self, codes: Tensor, levels: Tensor) -> Tensor:
        """codes, levels [B, N] -> code tokens [B, N, D]: the code's row of its level's table
        (what `_embed` gives a valid node), from one gather over the stacked tables."""
        tables = self.embeddings.embeddings
        stacked = torch.cat([tables[f"t_code_{lv}"].weight for lv in range(self.num_levels - 1)])
        first = torch.tensor([0, *self.codebook_sizes[:-2]], device=codes.device).cumsum(0)
        return self.embed_drop(F.embedding(codes + first[levels], stacked))

    def keep_recent(self, values: Tensor, offsets: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The most recent max_len items of each row: (values [M'], offsets [B+1], cut [B])."""
        lengths = offsets[1:] - offsets[:-1]
        if int(lengths.max()) <= self.config.max_len:  # nothing to cut (one sync, ~12 ops less)
            return values, offsets, torch.zeros_like(lengths, dtype=torch.bool)
        cut = (lengths - self.config.max_len).clamp(min=0)  # [B]
        row = torch.repeat_interleave(torch.arange(lengths.numel(), device=values.device), lengths)
        position = torch.arange(values.numel(), device=values.device) - offsets[row]
        keep = position >= cut[row]
        new_offsets = torch.cat([offsets[:1], (lengths - cut).cumsum(0)])
        return values[keep], new_offsets, cut > 0

    @torch.no_grad()  # inference only: training goes through forward_train
    def encode_history(
        self,
        values: Tensor,  # [M] int64 item indices of B histories, oldest first within a row
        offsets: Tensor,  # [B+1] int64
    ) -> HistoryState:
        """Prefill: one causal pass over BOS + the (most recent max_len) history items."""
        empty = torch.zeros(offsets.numel() - 1, 0, dtype=torch.long, device=values.device)
        return self.encode_history_and_tree(values, offsets, empty, empty, empty)[0]

    @torch.no_grad()
    def encode_history_and_tree(
        self,
        values: Tensor,  # [M] int64 item indices of B histories, oldest first within a row
        offsets: Tensor,  # [B+1] int64
        codes: Tensor,  # [B, N] int64 code of each tree node (N may be 0)
        levels: Tensor,  # [B, N] int64 level of that code, 0..L-2
        parents: Tensor,  # [B, N] int64 parent node, -1 = child of the history root
    ) -> tuple[HistoryState, Tensor]:  # (state, [B, N, Vmax] log-probs as `score_tree` gives)
        """`encode_history` and `score_tree` fused into one forward, for a tree known before the
        history is read (candidate scoring): per layer the history tokens attend causally and
        the tree nodes through the tree-attention op against this layer's history keys, so the
        state equals `encode_history`'s and the log-probs `score_tree`'s, in one pass."""
        self._check_history(values, offsets)
        values, offsets, truncated = self.keep_recent(values.long(), offsets.long())
        batch, nodes = offsets.numel() - 1, codes.shape[1]
        lengths = offsets[1:] - offsets[:-1] + 1  # [B] history tokens, BOS included
        x = self._embed_history(values, offsets)  # [B, T, D]
        tokens = x.shape[1]
        if nodes:
            self._check_tree(batch, codes, levels)
            plan = self._tree_plan(parents, lengths, tokens)
            x = torch.cat([x, self._embed_nodes(codes, levels)], dim=1)  # [B, T + N, D]
        keys, vals = [], []

        def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:  # k, v: [B, H, T + N, Dh]
            k_hist, v_hist = k[:, :, :tokens], v[:, :, :tokens]
            keys.append(k_hist)
            vals.append(v_hist)
            first = q.shape[2] - nodes  # q: [B, H, T + N, Dh], or [B, H, 1 + N, Dh] when kept
            if first == tokens:
                # Rows are right-padded, so plain causal attention is exact for every real token.
                out = F.scaled_dot_product_attention(
                    q[:, :, :first], k_hist, v_hist, is_causal=True
                )
            else:  # each row's last token alone, seeing all of its row's tokens
                real = torch.arange(tokens, device=k.device) < lengths[:, None]  # [B, T]
                out = F.scaled_dot_product_attention(
                    q[:, :, :first], k_hist, v_hist, attn_mask=real[:, None, None, :]
                )
            if not nodes:
                return out
            tree = self._tree_attention(
                q[:, :, first:], k_hist, v_hist, lengths, k[:, :, tokens:], v[:, :, tokens:], plan
            )
            return torch.cat([out, tree], dim=2)

        # The last block computes outputs only for each row's last history token (what the heads
        # and level 0 read) and the tree nodes; its keys and values still come from every token.
        # Measured: history pass 1.45-1.6x faster at batch 64-256 (ML-100K, ML-1M), same at 1.
        node_positions = torch.arange(tokens, tokens + nodes, device=x.device).expand(batch, -1)
        keep = torch.cat([lengths[:, None] - 1, node_positions], dim=1)  # [B, 1 + N]
        for layer, block in enumerate(self.blocks):
            x = block(x, attend, keep if layer == len(self.blocks) - 1 else None)
        state = self._state(torch.stack(keys), torch.stack(vals), lengths, x[:, 0], truncated)
        prefixes = self._node_prefixes(codes, levels, parents)
        log_probs = self._next_level_log_probs(self.norm(x[:, 1:]), levels, prefixes, state.hidden)
        return state, log_probs

    @torch.no_grad()
    def extend_history(
        self,
        state: HistoryState,  # B encoded histories, none cut to max_len
        values: Tensor,  # [M] int64 items appended to the B rows, oldest first within a row
        offsets: Tensor,  # [B+1] int64, at least one item per row
    ) -> HistoryState:
        """The state of each history with items appended, running only the new tokens: each
        attends over its row's cached keys and values and the new tokens up to itself (causal,
        as in `encode_history`), so the result equals `encode_history` of the whole histories up
        to float rounding. Positions are absolute, so the window must not slide: an extended row
        must stay within max_len items (`encode_history` cuts longer ones to the recent end)."""
        self._check_history(values, offsets)
        added = offsets[1:] - offsets[:-1]  # [B]
        old = state.lengths  # [B] cached tokens per row, BOS included
        if added.numel() != old.numel() or bool((added < 1).any()):
            raise RecommenderInputError(
                f"extend_history appends at least one item to each of the state's {old.numel()} "
                f"rows; got item counts {added.tolist()[:8]}"
            )
        if bool(state.truncated.any()) or int((old + added).max()) > self.config.max_len + 1:
            raise RecommenderInputError(
                f"an extended history would exceed max_len = {self.config.max_len} items (or "
                "was cut already): its window slides, so encode it afresh with encode_history"
            )
        width, cached = int(added.max()), state.keys.shape[3]
        step = torch.arange(width, device=values.device)  # [n] index of a new token
        real = step < added[:, None]  # [B, n]
        x = self.positions(torch.where(real, old[:, None] + step, 0))  # [B, n, D]
        x[real] += self._item_sums(values)
        x = self.embed_drop(x)
        # Key j of [cached | new] is seen by new token i when it is a real cached token of the
        # row (j < old) or a new token at or before i; built once for all layers.
        keys_at = torch.arange(cached + width, device=values.device)  # [T0 + n]
        seen = torch.where(
            keys_at < cached, keys_at < old[:, None, None], keys_at - cached <= step[:, None]
        )  # [B, n, T0 + n]
        # As in encode_history, the last block computes the last new token's output only.
        last = (added - 1)[:, None]  # [B, 1]
        seen_last = seen.gather(1, last[..., None].expand(-1, -1, seen.shape[2]))  # [B, 1, T0 + n]
        keys, vals = [], []  # per layer [B, H, T0 + n, Dh]
        for layer, block in enumerate(self.blocks):
            is_last = layer == len(self.blocks) - 1

            def attend(q: Tensor, k: Tensor, v: Tensor, layer=layer, is_last=is_last) -> Tensor:
                """q [B, H, n', Dh] of the new tokens over [cached | new] keys."""
                keys.append(torch.cat([state.keys[layer], k], dim=2))
                vals.append(torch.cat([state.values[layer], v], dim=2))
                mask = (seen_last if is_last else seen)[:, None]
                return F.scaled_dot_product_attention(q, keys[-1], vals[-1], attn_mask=mask)

            x = block(x, attend, last if is_last else None)
        # Row b's history is its old tokens then its new ones: slot j reads [cached | new] at j
        # below old[b], at T0 + j - old[b] from there (padding slots: any finite entry).
        slot = torch.arange(int((old + added).max()), device=values.device)  # [T]
        source = torch.where(slot < old[:, None], slot, cached + slot - old[:, None])  # [B, T]
        source = source.clamp_max(cached + width - 1)[None, :, None, :, None]

        def appended(per_layer: list[Tensor]) -> Tensor:  # [layers, B, H, T, Dh]
            stacked = torch.stack(per_layer)  # [layers, B, H, T0 + n, Dh]
            shape = (*stacked.shape[:3], source.shape[3], stacked.shape[4])
            return stacked.gather(3, source.expand(shape))

        return self._state(appended(keys), appended(vals), old + added, x[:, 0], state.truncated)

    def _state(self, keys, vals, lengths, last: Tensor, truncated) -> HistoryState:
        """The HistoryState of per-layer keys/values and the last history token's block output
        `last` [B, D] (final norm, level-0 head)."""
        hidden = self.norm(last)  # [B, D]
        level0 = self.level0_logits(hidden).log_softmax(dim=-1)
        return HistoryState(keys, vals, lengths, hidden, level0, truncated)

    @torch.no_grad()
    def score_tree(
        self,
        state: HistoryState,
        codes: Tensor,  # [B, N] int64 code of each node
        levels: Tensor,  # [B, N] int64 level of that code, 0..L-2
        parents: Tensor,  # [B, N] int64 parent node, -1 = child of the history root
        last: int | None = None,  # only the last `last` nodes' log-probs are wanted (None: all)
    ) -> Tensor:  # [B, N or last, Vmax] log-probs of level + 1 per node; -inf past its codebook
        """Score N code-prefix nodes per row in one pass against the cached history. The other
        nodes are context (a beam's earlier prefixes): their output heads are skipped."""
        self._check_tree(state.lengths.numel(), codes, levels)
        x = self._embed_nodes(codes, levels)  # [B, N, D]
        if not codes.shape[1]:  # no node (a draft that proposed nothing): nothing to score
            return self._next_level_log_probs(x, levels, None, state.hidden)
        plan = self._tree_plan(parents, state.lengths, state.keys.shape[3])
        for layer, block in enumerate(self.blocks):

            def attend(q: Tensor, k: Tensor, v: Tensor, layer: int = layer) -> Tensor:
                return self._tree_attention(
                    q, state.keys[layer], state.values[layer], state.lengths, k, v, plan
                )

            x = block(x, attend)
        prefixes = self._node_prefixes(codes, levels, parents)
        wanted = slice(-last if last else None, None)
        if prefixes is not None:
            prefixes = prefixes[:, wanted]
        return self._next_level_log_probs(
            self.norm(x[:, wanted]), levels[:, wanted], prefixes, state.hidden
        )

    def _tree_plan(self, parents: Tensor, lengths: Tensor, root_size: int):
        """The tree-attention plan of a forward, checked and masked once for all layers. The
        history keys' padding holds model outputs of padding tokens, so it is finite; a code
        prefix tree is at most L - 2 nodes deep below its level-0 node."""
        return prepare_tree(
            parents,
            lengths,
            root_size,
            dtype=self.bos.dtype,
            finite_padding=True,
            max_depth=self.num_levels - 2,
        )

    def _tree_attention(self, q, k_root, v_root, lengths, k_tree, v_tree, plan) -> Tensor:
        """Tree nodes' attention ([B, H, N, Dh] out) over one layer's history keys and values
        ([B, H, T, Dh]) and the tree's own ([B, H, N, Dh]), lengths [B], with the pass's plan."""
        return tree_attention(
            q,
            k_root,
            v_root,
            lengths,
            k_tree,
            v_tree,
            plan.parents,
            backend=self.config.attention_backend,
            plan=plan,
        )

    def _check_tree(self, batch: int, codes: Tensor, levels: Tensor) -> None:
        if codes.shape != levels.shape or codes.dim() != 2 or codes.shape[0] != batch:
            raise RecommenderInputError(
                f"codes {tuple(codes.shape)} and levels {tuple(levels.shape)} must both be "
                f"[B, N] with B = {batch} (the rows of the history)"
            )
        if bool(((levels < 0) | (levels > self.num_levels - 2)).any()):
            raise RecommenderInputError(
                f"node levels must lie in 0..{self.num_levels - 2}: a node of level l predicts "
                f"level l + 1 and the last level ({self.num_levels - 1}) predicts nothing"
            )
        sizes = torch.tensor(self.codebook_sizes, device=codes.device)
        if bool(((codes < 0) | (codes >= sizes[levels])).any()):
            raise RecommenderInputError(
                f"a node code lies outside its level's codebook (sizes {self.codebook_sizes})"
            )

    def _next_level_log_probs(
        self,
        h: Tensor,  # [B, N, D]
        levels: Tensor,  # [B, N]
        prefixes: Tensor | None,  # [B, N, L-1] each node's codes of levels 0..its level
        roots: Tensor,  # [B, D] each row's history state
    ) -> Tensor:  # [B, N, Vmax] log-probs of level + 1, -inf padded
        """Only the levels present are run (one host sync: free on CPU, and it skips most of the
        per-level ops of a small tree)."""
        out_shape = levels.shape
        vmax = max(self.codebook_sizes[1:])
        out = h.new_full((levels.numel(), vmax), float("-inf"))  # [B*N, Vmax]
        h, levels = h.flatten(0, 1), levels.flatten()  # [B*N, D], [B*N]
        prefixes = None if prefixes is None else prefixes.flatten(0, 1)  # [B*N, L-1]
        # Tied levels with a residual: each row's history-state query, normalised once.
        root_query = node_row = None
        if self.node_item_query is not None:
            root_query = self._item_query(roots)  # [B, D]
            node_row = torch.arange(out_shape[0], device=h.device).repeat_interleave(out_shape[1])
        counts = torch.bincount(levels, minlength=self.num_levels - 1).tolist()
        for level, count in enumerate(counts):
            if not count:
                continue
            # One level only: every node, no selection (a view, no index copies).
            rows = slice(None) if count == levels.numel() else levels == level
            prefix = None if prefixes is None else prefixes[rows, : level + 1]
            query = None if root_query is None else root_query[node_row[rows]]  # [n, D]
            scored = self._level_log_probs(h[rows], level + 1, prefix, query)
            out[rows, : self.codebook_sizes[level + 1]] = scored
        return out.unflatten(0, out_shape)

    def _level_log_probs(
        self,
        h: Tensor,  # [n, D] states of prefix nodes of length `level`
        level: int,  # >= 1, the level predicted
        prefixes: Tensor | None,  # [n, level] the nodes' prefixes (tied levels only)
        root_query: Tensor | None,  # [n, D] item query of each node's history state (residual)
    ) -> Tensor:  # [n, V_level]
        logits = self.code_heads[level](h)
        if self.config.tied_levels is not None:
            # The node's item query: from its own state, or (with a residual) the history
            # state's plus the node's correction.
            if root_query is None:
                query = self._item_query(h)  # [n, D]
            else:
                query = root_query + self.node_item_query(h)

            def item_logits(items: Tensor) -> Tensor:  # [n, W] -> [n, W]
                # On CPU F.embedding gathers ~5x faster than table[items], and [n, 1, D] @
                # [n, D, W] multiplies ~5x faster than [n, W, D] @ [n, D, 1] (measured at n 20-40,
                # W 9-85: the prefixes' item windows)
                rows = F.embedding(items, self._item_table())  # [n, W, D]
                return (query[:, None, :] @ rows.transpose(1, 2)).squeeze(1)

            child_logits = self._item_child_logits(item_logits, level, prefixes)
            return children_log_softmax(logits + child_logits)
        return logits.log_softmax(dim=-1)

    def draft_item_logits(self, scores: Tensor, prefixes: Tensor) -> Tensor:
        """scores [B, I] the rows' item logits (`item_scores` of their history states, computed
        once per decode), prefixes [B, W, level] -> [B, W, V_level]: what the tied draft head
        adds to its logits (draft_tied), the item objective's log-mass under each child of each
        prefix."""
        batch, width, level = prefixes.shape

        def item_logits(items: Tensor) -> Tensor:  # [B*W, n] -> [B*W, n]
            return scores.gather(1, items.reshape(batch, -1)).reshape(items.shape)

        logits = self._item_child_logits(item_logits, level, prefixes.reshape(-1, level))
        return logits.unflatten(0, (batch, width))

    def _prefix_index(self) -> ItemPrefixIndex:
        codes = self.item_codes
        return _PREFIX_INDEXES.get(
            codes, (codes,), lambda: ItemPrefixIndex.from_codes(codes, self.codebook_sizes)
        )

    def _item_child_logits(
        self, item_logits_of: Callable[[Tensor], Tensor], level: int, prefixes: Tensor
    ) -> Tensor:
        """prefixes [n, level] -> [n, V_level]: log of the item objective's mass (its logits,
        `item_logits_of(items [n, W]) -> [n, W]` for row r's state, exponentiated) on the items
        under each child of the prefix; -inf for codes no item under the prefix has. Each row
        reads the window of the code-sorted item table that holds its prefix's items."""
        index = self._prefix_index()
        start, end = index.runs(prefixes)  # [n]
        slot = start[:, None] + torch.arange(index.widths[level - 1], device=start.device)  # [n, W]
        inside = slot < end[:, None]
        slot = slot.clamp(max=self.num_items - 1)
        item_logits = item_logits_of(index.order[slot]).masked_fill(~inside, float("-inf"))
        top = item_logits.max(dim=1, keepdim=True).values.detach()  # [n, 1] for stability
        top = top.masked_fill(top.isinf(), 0.0)
        mass = item_logits.new_zeros(item_logits.shape[0], self.codebook_sizes[level])
        mass = mass.scatter_add(1, index.sorted_codes[slot, level], (item_logits - top).exp())
        # No log of an empty child's 0 mass: its gradient would be 0 / 0.
        logged = mass.clamp_min(torch.finfo(mass.dtype).tiny).log() + top
        return logged.masked_fill(mass == 0, float("-inf"))

    def _node_prefixes(self, codes: Tensor, levels: Tensor, parents: Tensor) -> Tensor | None:
        """codes, levels, parents [B, N] -> [B, N, L-1]: each node's codes at levels 0..its
        level, read up its ancestors (None unless the tied levels need them)."""
        if self.config.tied_levels is None:
            return None
        depth = self.num_levels - 1
        prefixes = codes.new_zeros(*codes.shape, depth + 1)  # slot `depth`: discarded writes
        node = torch.arange(codes.shape[1], device=codes.device).expand_as(codes)
        for _ in range(depth):
            real = node >= 0
            safe = node.clamp(min=0)
            slot = torch.where(real, levels.gather(1, safe), depth)
            prefixes.scatter_(2, slot[..., None], codes.gather(1, safe)[..., None])
            node = torch.where(real, parents.gather(1, safe), -1)
        return prefixes[..., :depth]

    # ------------------------------------------------------------------------------ training

    def forward(self, layout: TrainLayout) -> dict[str, Tensor]:
        """`forward_train`; DistributedDataParallel calls a module through `forward`."""
        return self.forward_train(layout)

    def forward_train(self, layout: TrainLayout) -> dict[str, Tensor]:
        """Losses of one batch (each a mean cross-entropy per predicted code; `loss` is the
        weighted total): `level_l` for the backbone's level l, `parallel`, `long_id`, `draft`."""
        levels, tokens = self.num_levels, layout.num_history_tokens
        if tokens > self.config.max_len + 1:
            raise RecommenderInputError(
                f"training windows hold up to max_len + 1 = {self.config.max_len + 1} items, "
                f"got {tokens}; cut windows to the model's max_len first"
            )
        batch, branches = layout.branch_anchor.shape
        next_codes = self.item_codes[layout.next_items.clamp(min=0)]  # [B, T, L]
        has_branch = layout.branch_anchor >= 0  # [B, P]
        anchor = layout.branch_anchor.clamp(min=0)
        branch_items = layout.next_items.gather(1, anchor)  # [B, P]
        branch_codes = next_codes.gather(1, anchor[..., None].expand(-1, -1, levels))  # [B, P, L]
        node_codes = branch_codes[:, :, :-1].reshape(batch, -1)  # [B, P*(L-1)]
        node_levels = torch.arange(levels - 1, device=node_codes.device).repeat(branches)
        node_levels = node_levels.expand(batch, -1)
        node_valid = has_branch.repeat_interleave(levels - 1, dim=1)
        hist, nodes = self._embed(
            layout.hist_items, layout.hist_offsets, node_codes, node_levels, node_valid
        )
        x = torch.cat([hist, nodes], dim=1)  # [B, T + P*(L-1), D]
        # The tree mask as an additive float mask (SDPA's CPU kernel runs faster with it than
        # with a bool mask), built once for all layers.
        hidden = ~layout.visibility()[:, None]  # [B, 1, N, N]
        visible = torch.zeros(hidden.shape, dtype=x.dtype, device=x.device).masked_fill_(
            hidden, float("-inf")
        )

        def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=visible)

        for block in self.blocks:
            x = block(x, attend)
        h = self.norm(x)
        losses: dict[str, Tensor] = {}
        real = layout.next_items >= 0  # [B, T]
        states = h[:, :tokens][real]  # [R, D] every real history position
        state_items = layout.next_items[real]  # [R] the item each of them predicts
        if not self.config.level0_from_items:  # else the item objective trains level 0
            losses["level_0"] = F.cross_entropy(
                self.code_heads[0](states), next_codes[..., 0][real]
            )
        node_h = h[:, tokens:].unflatten(1, (branches, levels - 1))  # [B, P, L-1, D]
        # Each branch's history state: the state at its anchor, whose next item it spells.
        anchor_h = h[:, :tokens].gather(1, anchor[..., None].expand(-1, -1, h.shape[-1]))
        root_query = None  # [M', D] its item query (tied residual), shared by the levels
        if self.node_item_query is not None:
            root_query = self._item_query(anchor_h[has_branch])
        for level in range(1, levels):
            log_probs = self._level_log_probs(
                node_h[:, :, level - 1][has_branch],
                level,
                branch_codes[..., :level][has_branch],
                root_query,
            )
            losses[f"level_{level}"] = F.nll_loss(log_probs, branch_codes[..., level][has_branch])
        total = sum(losses.values())
        objective = self.config.item_objective
        if objective is not None:
            losses["item"] = F.cross_entropy(self.item_scores(states), state_items)
            total = total + objective.weight * losses["item"]

        # The draft head learns from the history states at a stratified subset of the branch
        # anchors, to bound its cost (per state: the item scores its tied logits read, a GRU
        # step per level); the parallel and long-ID heads from the same states, or with a
        # position stride from every n-th history position.
        stride = max(1, branches // self.config.head_branches)
        head_rows = has_branch[:, ::stride]  # [B, P']
        anchor_h = anchor_h[:, ::stride][head_rows]  # [M, D] the subset's states
        target_codes = branch_codes[:, ::stride][head_rows]  # [M, L]
        target_items = branch_items[:, ::stride][head_rows]  # [M]
        if self.config.detach_heads:
            anchor_h, states = anchor_h.detach(), states.detach()
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
                code_h, code_items = states[::every], state_items[::every]
            if config.item_loss:
                losses[name] = head.catalogue_loss(code_h, table, code_items)
            else:
                losses[name] = head.loss(code_h, table[code_items])
            total = total + config.weight * losses[name]
        if self.draft_head is not None:
            item_logits = None  # per level [M, V]: what the tied head adds to its logits
            if self.config.draft_tied:
                # The tied head learns a correction on top of the item objective, held fixed
                # here: the draft loss trains the head, not the item table.
                with torch.no_grad():
                    scores = self.item_scores(anchor_h)  # [M, I]
                    item_logits = [
                        self.draft_item_logits(scores, target_codes[:, None, :level])[:, 0]
                        for level in range(1, levels)
                    ]
            losses["draft"] = self.draft_head.loss(anchor_h, target_codes, item_logits)
            total = total + self.config.draft_head.weight * losses["draft"]
        losses["loss"] = total
        return losses
