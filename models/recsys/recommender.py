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
their siblings (see `layout`). Inference:

    state = model.encode_history(values, offsets)   # one causal pass, K/V cached per layer
    state = model.encode_history(values, offsets, times)   # a model with a time bias
    log_probs = model.score_tree(state, codes, levels, parents)   # one tree-attention pass
    state, log_probs = model.encode_history_and_tree(values, offsets, codes, levels, parents)

`score_tree` is stateless with respect to the tree: the history cache is the shared root and
never grows (one item is predicted), so a decoder passes every prefix node it needs scored
(a beam's prefixes, a drafted trie) and nothing has to be committed. The third form fuses both
into one pass when the tree is known before the history is read (candidate scoring).

The model's parts: `config` (what to build), `blocks` (the transformer block, the history
state), `code_levels` (the next-code distributions and the item objective), `training` (the
training forward and its losses); this module holds the model, its embeddings and the inference
passes.

Shape letters: B users, M history items, T history tokens (BOS included), N tree nodes,
D model width, H heads, L code levels (collision code included), V codes, I items, Q digits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollection

from genrec_spec.kernels import prepare_tree
from genrec_spec.models.recsys.attention import (
    PointwiseRule,
    SoftmaxRule,
    bias_pairs,
    pair_bias,
    relative_bias,
    tree_biases,
    tree_distance,
)
from genrec_spec.models.recsys.blocks import Block, HistoryState, HstuBlock
from genrec_spec.models.recsys.code_levels import CodeLevels
from genrec_spec.models.recsys.config import RecommenderConfig
from genrec_spec.models.recsys.errors import RecommenderInputError
from genrec_spec.models.recsys.heads import LongIdHeads, ParallelLevelHeads, RecurrentDraftHead
from genrec_spec.models.recsys.times import HistoryTimes, time_gaps, token_times
from genrec_spec.models.recsys.training import TrainingForward

__all__ = [
    "HistoryState",
    "HistoryTimes",
    "RecommenderConfig",
    "RecommenderInputError",
    "SemanticIdRecommender",
]


class SemanticIdRecommender(CodeLevels, TrainingForward, nn.Module):
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
                f"dim {config.dim} is not divisible by heads {config.heads}",
                "choose a model width that is a multiple of the attention heads",
            )
        if (
            item_codes.dim() != 2
            or item_codes.shape[1] != len(codebook_sizes)
            or len(codebook_sizes) < 2
        ):
            raise RecommenderInputError(
                f"item_codes {tuple(item_codes.shape)} must be [items, L] with L = "
                f"len(codebook_sizes) = {len(codebook_sizes)} >= 2 levels",
                "pass the prepared data's item_codes and codebook_sizes (recsys.data)",
            )
        self.config = config
        self.codebook_sizes = [int(v) for v in codebook_sizes]
        self.register_buffer("item_codes", item_codes.long(), persistent=True)
        self.long_id_sizes = [int(v) for v in long_id_sizes] if long_ids is not None else None
        self.register_buffer("long_ids", None if long_ids is None else long_ids.long())
        self._build_backbone(item_codes.device)
        self._build_heads()
        self._init_weights()
        if self.node_item_query is not None:  # the levels start as the item softmax's
            nn.init.zeros_(self.node_item_query.weight)
        if config.draft_tied:  # so does the draft head
            for out in self.draft_head.out:
                nn.init.zeros_(out.weight)

    def _build_backbone(self, device: torch.device) -> None:
        """The embedding tables (one torchrec collection), positions, blocks and final norm."""
        config, levels, dim = self.config, self.num_levels, self.config.dim
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
        self.embeddings = EmbeddingCollection(tables=tables, device=device)
        self.feature_keys = [name for table in tables for name in table.feature_names]
        self.bos = nn.Parameter(torch.zeros(dim))
        self.positions = nn.Embedding(config.max_len + 1, dim)
        self.level_embedding = nn.Embedding(levels - 1, dim)
        self.embed_drop = nn.Dropout(config.dropout)
        hstu = config.block == "hstu"
        kind = HstuBlock if hstu else Block
        self.blocks = nn.ModuleList(kind(config) for _ in range(config.layers))
        # Every pass's attention (prefill, tree scoring, training) is this rule's. HSTU divides
        # its weights by the most tokens a history holds.
        self.attention_rule = (
            PointwiseRule(float(config.max_len + 1), config.relative_bias, config.time_bias)
            if hstu
            else SoftmaxRule(config.attention_backend)
        )
        self.norm = nn.LayerNorm(dim)

    def _build_heads(self) -> None:
        """The code heads, and the parallel, long-ID and draft heads the config asks for."""
        config, dim = self.config, self.config.dim
        # code_heads[l] predicts level l (from the last history token for l = 0); untied from
        # the code embedding tables, which ranked better.
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
            if config.long_id_heads and self.long_ids is not None
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
    def uses_times(self) -> bool:
        """True when the model reads timestamps with its histories (`models.recsys.times`):
        its passes then need `HistoryTimes`."""
        return self.config.time_bias

    @property
    def forced_codes_free(self) -> bool:
        """True when the code levels are normalised over each prefix's children only
        (tied levels): a prefix with one child gives it log-prob exactly 0, so a decoder
        need not score it (most deeper prefixes of a catalogue have one child)."""
        return self.config.tied_levels is not None

    @property
    def item_objective(self):  # -> ItemObjectiveConfig | None
        """The item objective's config; None for a model trained without it."""
        return self.config.item_objective

    def backbone_parameters(self) -> list[nn.Parameter]:
        """Everything but the draft heads (what `freeze_backbone` freezes)."""
        heads = {id(p) for m in self.draft_heads() for p in m.parameters()}
        return [p for p in self.parameters() if id(p) not in heads]

    def draft_heads(self) -> list[nn.Module]:
        return [m for m in (self.parallel_heads, self.long_id_heads, self.draft_head) if m]

    # ----------------------------------------------------------------------------- embedding

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
                f"{values.dtype}",
                "pass the histories' item indices as one int64 tensor",
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
                f"at M = {values.numel()}; got {offsets.tolist()[:8]}...",
                "pass offsets [0, len(row 0), len(row 0) + len(row 1), ...]",
            )
        if values.numel() and (int(values.min()) < 0 or int(values.max()) >= self.num_items):
            raise RecommenderInputError(
                f"history item indices must lie in [0, {self.num_items})",
                "map raw item ids to item indices (items.parquet item_index) first",
            )

    def _check_times(
        self, times: HistoryTimes | None, values: Tensor, offsets: Tensor
    ) -> HistoryTimes | None:
        """The times a pass reads: a time-aware model needs every item's time and every row's
        query time; other models read none (times given to them are ignored, so a caller may
        pass the times it has to any model)."""
        if not self.uses_times:
            return None
        if times is None:
            raise RecommenderInputError(
                "this model reads timestamps (model.time_bias): it needs the time of every "
                "history item and of each prediction",
                "pass times=HistoryTimes(values=[M] item times, query=[B] prediction times) "
                "(seconds, as in training)",
            )
        batch = offsets.numel() - 1
        if times.values.shape != values.shape or times.query.shape != (batch,):
            raise RecommenderInputError(
                f"times must be [M] = {tuple(values.shape)} (one per history item) and [B] = "
                f"({batch},) (one query time per row); got {tuple(times.values.shape)} and "
                f"{tuple(times.query.shape)}",
                "pass one timestamp per history item and one per history",
            )
        return times

    # ----------------------------------------------------------------------------- inference
    # Inference reads the EmbeddingCollection's tables directly instead of through a
    # KeyedJaggedTensor: the KJT's bookkeeping and `_embed`'s per-level node loop are a large
    # part of a small batch's history pass. Same tables, same sums.

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

    def keep_recent(
        self, values: Tensor, offsets: Tensor, times: HistoryTimes | None = None
    ) -> tuple[Tensor, Tensor, Tensor, HistoryTimes | None]:
        """The most recent max_len items of each row: (values [M'], offsets [B+1], cut [B], the
        kept items' times)."""
        lengths = offsets[1:] - offsets[:-1]
        if int(lengths.max()) <= self.config.max_len:  # nothing to cut (one sync, ~12 ops less)
            return values, offsets, torch.zeros_like(lengths, dtype=torch.bool), times
        cut = (lengths - self.config.max_len).clamp(min=0)  # [B]
        row = torch.repeat_interleave(torch.arange(lengths.numel(), device=values.device), lengths)
        position = torch.arange(values.numel(), device=values.device) - offsets[row]
        keep = position >= cut[row]
        new_offsets = torch.cat([offsets[:1], (lengths - cut).cumsum(0)])
        if times is not None:
            times = HistoryTimes(times.values[keep], times.query)
        return values[keep], new_offsets, cut > 0, times

    @torch.no_grad()  # inference only: training goes through forward_train
    def encode_history(
        self,
        values: Tensor,  # [M] int64 item indices of B histories, oldest first within a row
        offsets: Tensor,  # [B+1] int64
        times: HistoryTimes | None = None,  # what a model with a time bias needs (`uses_times`)
    ) -> HistoryState:
        """Prefill: one causal pass over BOS + the (most recent max_len) history items."""
        empty = torch.zeros(offsets.numel() - 1, 0, dtype=torch.long, device=values.device)
        return self.encode_history_and_tree(values, offsets, empty, empty, empty, times)[0]

    @torch.no_grad()
    def encode_history_and_tree(
        self,
        values: Tensor,  # [M] int64 item indices of B histories, oldest first within a row
        offsets: Tensor,  # [B+1] int64
        codes: Tensor,  # [B, N] int64 code of each tree node (N may be 0)
        levels: Tensor,  # [B, N] int64 level of that code, 0..L-2
        parents: Tensor,  # [B, N] int64 parent node, -1 = child of the history root
        times: HistoryTimes | None = None,  # what a model with a time bias needs (`uses_times`)
    ) -> tuple[HistoryState, Tensor]:  # (state, [B, N, Vmax] log-probs as `score_tree` gives)
        """`encode_history` and `score_tree` fused into one forward, for a tree known before the
        history is read (candidate scoring): per layer the history tokens attend causally and
        the tree nodes through the tree-attention op against this layer's history keys, so the
        state equals `encode_history`'s and the log-probs `score_tree`'s, in one pass."""
        self._check_history(values, offsets)
        times = self._check_times(times, values, offsets)
        values, offsets, truncated, times = self.keep_recent(values.long(), offsets.long(), times)
        batch, nodes = offsets.numel() - 1, codes.shape[1]
        lengths = offsets[1:] - offsets[:-1] + 1  # [B] history tokens, BOS included
        x = self._embed_history(values, offsets)  # [B, T, D]
        tokens = x.shape[1]
        if nodes:
            self._check_tree(batch, codes, levels)
            plan = self._tree_plan(parents, lengths, tokens)
            x = torch.cat([x, self._embed_nodes(codes, levels)], dim=1)  # [B, T + N, D]
        keys, vals = [], []

        time = torch.arange(tokens, device=x.device)  # [T] a history token's position
        every = last = below = None  # query-key distances, for blocks with a relative bias
        if self.config.relative_bias:
            every = time[:, None] - time  # [T, T] among the history tokens
            below = tree_distance(lengths, tokens)  # [B, 1, T] a tree node's: one past the last
            last = below - 1  # [B, 1, T] each row's last token's
        gaps = query_gaps = None  # their time buckets, for blocks with a time bias
        if times is not None:
            key_times, query_times = token_times(times, offsets, tokens)  # [B, T] each
            gaps = time_gaps(query_times, key_times)  # [B, T, T]
            # A row's last token and its tree nodes ask for the row's query time.
            query_gaps = time_gaps(times.query[:, None], key_times)  # [B, 1, T]
        # The pairs' entries in the blocks' bias tables, computed once for every block, and the
        # tree nodes' biases in every block, looked up once (the blocks' `table`s).
        tables = self._bias_tables()
        pairs_every = bias_pairs(tables[0], every, gaps)
        pairs_last = bias_pairs(tables[0], last, query_gaps)
        node_biases = tree_biases(tables, below, query_gaps) if nodes else None

        def attend(q: Tensor, k: Tensor, v: Tensor, table: Tensor | None) -> Tensor:
            k_hist, v_hist = k[:, :, :tokens], v[:, :, :tokens]  # k, v: [B, H, T + N, Dh]
            keys.append(k_hist)
            vals.append(v_hist)
            first = q.shape[2] - nodes  # q: [B, H, T + N, Dh], or [B, H, 1 + N, Dh] when kept
            if first == tokens:
                # Rows are right-padded, so plain causal attention is exact for every real token.
                out = self.attention_rule.dense(
                    q[:, :, :first], k_hist, v_hist, causal=True,
                    bias=pair_bias(table, pairs_every),
                )  # fmt: skip
            else:  # each row's last token alone, seeing all of its row's tokens
                real = time < lengths[:, None]  # [B, T]
                out = self.attention_rule.dense(
                    q[:, :, :first], k_hist, v_hist, real[:, None, None, :],
                    bias=pair_bias(table, pairs_last),
                )  # fmt: skip
            if not nodes:
                return out
            tree = self.attention_rule.tree(
                q[:, :, first:], k_hist, v_hist, lengths, k[:, :, tokens:], v[:, :, tokens:], plan,
                node_biases[len(keys) - 1],  # this block's: it appended its keys above
            )  # fmt: skip
            return torch.cat([out, tree], dim=2)

        # The last block computes outputs only for each row's last history token (what the heads
        # and level 0 read) and the tree nodes; its keys and values still come from every token.
        node_positions = torch.arange(tokens, tokens + nodes, device=x.device).expand(batch, -1)
        keep = torch.cat([lengths[:, None] - 1, node_positions], dim=1)  # [B, 1 + N]
        for layer, block in enumerate(self.blocks):
            x = block(x, attend, keep if layer == len(self.blocks) - 1 else None)
        state = self._state(
            torch.stack(keys), torch.stack(vals), lengths, x[:, 0], truncated, query_gaps
        )
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
        must stay within max_len items (`encode_history` cuts longer ones to the recent end).
        Not for a model with a time bias: its last history token asks for the prediction's time,
        which the appended items change, so its cached keys and values would be stale."""
        if self.uses_times:
            raise RecommenderInputError(
                "extend_history cannot extend a time-aware model's history (model.time_bias): "
                "the last cached token's keys depend on the time of the prediction",
                "encode the whole history afresh with encode_history",
            )
        self._check_history(values, offsets)
        added = offsets[1:] - offsets[:-1]  # [B]
        old = state.lengths  # [B] cached tokens per row, BOS included
        if added.numel() != old.numel() or bool((added < 1).any()):
            raise RecommenderInputError(
                f"extend_history appends at least one item to each of the state's {old.numel()} "
                f"rows; got item counts {added.tolist()[:8]}",
                "pass one or more new items for every row of the state",
            )
        if bool(state.truncated.any()) or int((old + added).max()) > self.config.max_len + 1:
            raise RecommenderInputError(
                f"an extended history would exceed max_len = {self.config.max_len} items (or "
                "was cut already): its window slides",
                "encode it afresh with encode_history",
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

        def last_row(pairs: Tensor) -> Tensor:  # [B, n, T0 + n] -> [B, 1, T0 + n]
            return pairs.gather(1, last[..., None].expand(-1, -1, pairs.shape[2]))

        distance = last_distance = None  # query-key distances, for a relative position bias
        if self.config.relative_bias:  # new token i at old + i; key j at j, or old + j - T0
            key_at = torch.where(keys_at < cached, keys_at, old[:, None] + keys_at - cached)
            distance = (old[:, None] + step)[:, :, None] - key_at[:, None, :]  # [B, n, T0 + n]
            last_distance = last_row(distance)
        seen_last = last_row(seen)

        keys, vals = [], []  # per layer [B, H, T0 + n, Dh]
        for layer, block in enumerate(self.blocks):
            is_last = layer == len(self.blocks) - 1

            def attend(q, k, v, table, layer=layer, is_last=is_last) -> Tensor:
                """q [B, H, n', Dh] of the new tokens over [cached | new] keys."""
                keys.append(torch.cat([state.keys[layer], k], dim=2))
                vals.append(torch.cat([state.values[layer], v], dim=2))
                mask, pairs = (seen_last, last_distance) if is_last else (seen, distance)
                return self.attention_rule.dense(
                    q, keys[-1], vals[-1], mask[:, None], bias=relative_bias(table, pairs)
                )

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

    def _state(self, keys, vals, lengths, last: Tensor, truncated, query_gaps=None) -> HistoryState:
        """The HistoryState of per-layer keys/values and the last history token's block output
        `last` [B, D] (final norm, level-0 head)."""
        hidden = self.norm(last)  # [B, D]
        level0 = self.level0_logits(hidden).log_softmax(dim=-1)
        return HistoryState(keys, vals, lengths, hidden, level0, truncated, query_gaps)

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
        below = (  # [B, 1, S] for the blocks' relative position bias
            tree_distance(state.lengths, state.keys.shape[3]) if self.config.relative_bias else None
        )
        # every block's biases, looked up once (each block hands `attend` its tables)
        biases = tree_biases(self._bias_tables(), below, state.query_gaps)
        for layer, block in enumerate(self.blocks):

            def attend(q, k, v, table, layer: int = layer) -> Tensor:
                return self.attention_rule.tree(
                    q, state.keys[layer], state.values[layer], state.lengths, k, v, plan,
                    biases[layer],
                )  # fmt: skip

            x = block(x, attend)
        prefixes = self._node_prefixes(codes, levels, parents)
        wanted = slice(-last if last else None, None)
        if prefixes is not None:
            prefixes = prefixes[:, wanted]
        return self._next_level_log_probs(
            self.norm(x[:, wanted]), levels[:, wanted], prefixes, state.hidden
        )

    def _bias_tables(self) -> list:
        """Each block's relative bias tables (`attention.BiasTables`), None without."""
        return [block.bias_tables() for block in self.blocks]

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

    def _check_tree(self, batch: int, codes: Tensor, levels: Tensor) -> None:
        if codes.shape != levels.shape or codes.dim() != 2 or codes.shape[0] != batch:
            raise RecommenderInputError(
                f"codes {tuple(codes.shape)} and levels {tuple(levels.shape)} must both be "
                f"[B, N] with B = {batch} (the rows of the history)",
                "pass one row of tree nodes per history",
            )
        if bool(((levels < 0) | (levels > self.num_levels - 2)).any()):
            raise RecommenderInputError(
                f"node levels must lie in 0..{self.num_levels - 2}: a node of level l predicts "
                f"level l + 1 and the last level ({self.num_levels - 1}) predicts nothing",
                "give each node the level of its code (its depth below the history)",
            )
        sizes = torch.tensor(self.codebook_sizes, device=codes.device)
        if bool(((codes < 0) | (codes >= sizes[levels])).any()):
            raise RecommenderInputError(
                f"a node code lies outside its level's codebook (sizes {self.codebook_sizes})",
                "pass codes of the model's catalogue (its item_codes)",
            )
