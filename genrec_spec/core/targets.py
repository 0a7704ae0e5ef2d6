"""Target adapters: score a whole draft tree in one forward, then commit the kept path.

A target is used through a per-call cache handle (its decoding state):

    cache = target.prefill(tokens, lengths, capacity, hidden_layers)  # caches tokens[:, :len-1]
    logits = target.score_tree(cache, tree)    # [B, N, V]; the root is the first uncached token
    target.commit(cache, nodes, counts)        # keep nodes[b, :counts[b]] of the scored tree

A target whose ``scores_prefill`` is true also offers

    cache, logits = target.prefill_scored(tokens, lengths, capacity)  # [B, 1, V]

which caches every prompt token and returns each row's last token's logits: the first decoding
step's scores without a pass of their own (transformers' prefill does the same). The loop takes
its first token from them where no drafter needs the prompt's hidden states.

Beam search keeps every scored beam prefix instead of one path, so it grows one tree per row
pass by pass, each pass scoring only its new nodes:

    logits = target.grow_tree(cache, tokens, parents, needed)  # [B, M, V], M new nodes per row

where parents index the nodes scored since the last commit (the first grow's nodes hang under
the committed root: parent -1), and ``needed`` [B, M] marks the new nodes whose outputs the
caller reads (None: all; a node whose candidates beam search knows without the target, a
forced token that costs nothing, is not read). A target may skip the others' outputs, but every
new node still conditions its descendants; the LLM targets compute them all, since a node's K/V
is kept for its children anyway. A later commit keeps a path among all of them. A grow's
outputs are read before the next grow, which may reuse their memory (the recommender does).

After prefill and score_tree, ``cache.hidden`` maps each requested layer to hidden states
[B, T or N, D] of the tokens just processed (for trained drafters such as EAGLE), or is empty.

Three optional attributes: ``prompt_vocab_size`` for a target whose prompts are in a
vocabulary of their own, ``outputs_log_probs = True`` for one whose outputs are normalised
log-probabilities, which beam search then reads as they are, and ``forced_tokens_free = True``
for one whose log-probs are normalised over a catalogue's allowed tokens, so a forced token
costs exactly 0 (the recommender: ``recsys.target.RecommenderTarget``, item ids in, code
tokens out).

Adapters: ``CallableTarget`` (any causal ids -> logits callable; no cache), ``HFTarget`` (any
``transformers`` causal LM; 4D tree mask + position ids + a DynamicCache) and ``NativeTarget``
(the project's Llama with its static KV cache). ``as_target`` picks one.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from genrec_spec.core.tree import paths, topology
from genrec_spec.core.types import DecodeInputError, DraftTree, write_ragged


class Target(Protocol):
    vocab_size: int | None  # None until known (CallableTarget learns it at prefill)
    max_length: int  # the longest sequence (prompt + generated + draft depth) it can score

    def prefill(
        self, tokens: Tensor, lengths: Tensor, capacity: int, hidden_layers: Sequence[int] = ()
    ) -> Any: ...

    def score_tree(self, cache: Any, tree: DraftTree) -> Tensor: ...

    def grow_tree(
        self, cache: Any, tokens: Tensor, parents: Tensor, needed: Tensor | None = None
    ) -> Tensor: ...

    def commit(self, cache: Any, nodes: Tensor, counts: Tensor) -> None: ...


def grown(tree: DraftTree | None, tokens: Tensor, parents: Tensor) -> DraftTree:
    """The pending tree after a grow: ``tree`` (None before the first) with the new nodes
    (tokens, parents [B, M]) appended."""
    if tree is None:
        return DraftTree(tokens=tokens, parents=parents)
    return DraftTree(
        tokens=torch.cat([tree.tokens, tokens], dim=1),
        parents=torch.cat([tree.parents, parents], dim=1),
    )


@dataclass
class SequenceCache:
    """Cache handle of a CallableTarget: the committed tokens themselves."""

    tokens: Tensor  # [B, T] committed tokens, right-padded
    lengths: Tensor  # [B]
    tree: DraftTree | None = None
    hidden: dict[int, Tensor] = field(default_factory=dict)


class CallableTarget:
    """Any causal ``ids [B, T] -> logits [B, T, V]`` callable (logits at t may depend only on
    ids[:, :t + 1]). No cache: every node's full sequence (committed tokens + its root-to-node
    path) is rebuilt and scored; slow but universal, and it reads lengths on the host to size
    its buffer. Tiny test models plug in here."""

    def __init__(
        self,
        fn: Callable[[Tensor], Tensor],
        vocab_size: int | None = None,
        max_length: int = 1 << 20,
    ) -> None:
        self.fn = fn
        self.vocab_size = vocab_size
        self.max_length = max_length

    def prefill(
        self, tokens: Tensor, lengths: Tensor, capacity: int, hidden_layers: Sequence[int] = ()
    ) -> SequenceCache:
        if hidden_layers:
            raise DecodeInputError(
                "a CallableTarget exposes no hidden states",
                "use HFTarget or NativeTarget for drafters that need them",
            )
        if self.vocab_size is None:
            self.vocab_size = int(self.fn(tokens[:1, :1]).shape[-1])
        committed = torch.where(
            torch.arange(tokens.shape[1], device=tokens.device) < (lengths - 1)[:, None], tokens, 0
        )
        return SequenceCache(tokens=committed, lengths=lengths - 1)

    def score_tree(self, cache: SequenceCache, tree: DraftTree) -> Tensor:
        cache.tree = tree
        return self._score_last(cache, tree, tree.num_nodes)

    def grow_tree(
        self, cache: SequenceCache, tokens: Tensor, parents: Tensor, needed: Tensor | None = None
    ) -> Tensor:
        cache.tree = grown(cache.tree, tokens, parents)
        return self._score_last(cache, cache.tree, tokens.shape[1])

    def _score_last(self, cache: SequenceCache, tree: DraftTree, m: int) -> Tensor:
        """Logits [B, M, V] of the tree's last m nodes."""
        batch, n = tree.tokens.shape
        ancestors, depth = topology(tree.parents)
        path = paths(ancestors, depth)[:, n - m :]  # [B, M, N] root-to-node node indices
        path_tokens = tree.tokens.gather(1, path.clamp_min(0).flatten(1)).view(batch, m, n)
        # Node i's sequence: the committed tokens, then its root-to-node path (0-padded).
        seq = torch.cat(
            [cache.tokens[:, None].expand(-1, m, -1), tree.tokens.new_zeros(batch, m, n)], dim=2
        )  # [B, M, T + N]
        columns = cache.lengths[:, None, None] + torch.arange(n, device=seq.device)
        seq = seq.scatter(2, columns.expand(-1, m, -1), torch.where(path >= 0, path_tokens, 0))
        logits = self.fn(seq.flatten(0, 1))  # [B * M, T + N, V]
        last = (cache.lengths[:, None] + depth[:, n - m :]).flatten()  # each node's own position
        return logits[torch.arange(batch * m, device=last.device), last].view(batch, m, -1)

    def commit(self, cache: SequenceCache, nodes: Tensor, counts: Tensor) -> None:
        room = int(cache.lengths.max()) + nodes.shape[1] - cache.tokens.shape[1]
        if room > 0:
            cache.tokens = torch.cat([cache.tokens, cache.tokens.new_zeros(len(counts), room)], 1)
        values = cache.tree.tokens.gather(1, nodes)
        cache.tokens = write_ragged(cache.tokens, cache.lengths, values, counts)
        cache.lengths = cache.lengths + counts
        cache.tree = None


@dataclass
class HFCache:
    """Cache handle of an HFTarget. The DynamicCache holds one slot sequence shared by all rows;
    ``slot_valid`` marks which slots are real tokens of each row (padding and dropped slots
    are masked out). Committed tokens not yet in the cache (accepted tree nodes other than the
    root) wait in ``pending``, left-padded, and are fed again before the next tree."""

    past: Any  # transformers DynamicCache
    # [B, S] bool. A row's valid slots hold its positions 0, 1, 2, ... in order (root_position =
    # its valid slots + its pending tokens), so a slot's position is their running count.
    slot_valid: Tensor
    root_position: Tensor  # [B] position of the next root
    pending: Tensor  # [B, P] tokens, left-padded
    pending_valid: Tensor  # [B, P] bool
    hidden_layers: tuple[int, ...] = ()
    scored: int = 0  # slots the last uncommitted pass appended (pending + tree)
    tree: DraftTree | None = None
    hidden: dict[int, Tensor] = field(default_factory=dict)


class HFTarget:
    """Any ``transformers`` causal LM as a target or draft. A tree is scored with a custom 4D
    attention mask (every node sees the row's cached tokens, the pending tokens and its own
    ancestors) and explicit position ids; commit crops the cache back to the root's slot and
    re-feeds the accepted nodes as a prefix of the next pass (simple and correct; the
    recomputation costs at most the draft depth in tokens).

    Models with sliding-window layers (``config.layer_types`` naming "sliding_attention": Gemma-2
    and -3, Qwen-2...) get one mask per layer type, since a 4D mask reaches every layer as is:
    the sliding layers' mask also hides keys ``sliding_window`` or more positions back."""

    def __init__(self, model: Any, max_length: int | None = None) -> None:
        self.model = model.eval()
        self.device = model.device
        config = model.config
        self.vocab_size = int(config.vocab_size)
        self.max_length = max_length or int(getattr(config, "max_position_embeddings", 1 << 20))
        sliding = "sliding_attention" in (getattr(config, "layer_types", None) or ())
        self.sliding_window = getattr(config, "sliding_window", None) if sliding else None
        parameters = inspect.signature(model.forward).parameters
        self.keeps_logits = "logits_to_keep" in parameters
        # Newer transformers name the KV cache argument and output `cache` (past_key_values is
        # deprecated there); older ones know only past_key_values
        self.cache_name = "cache" if "cache" in parameters else "past_key_values"

    def _forward(
        self,
        cache: HFCache,
        tokens: Tensor,  # [B, Q]
        positions: Tensor,  # [B, Q]
        mask: Tensor,  # [B, Q, S + Q] bool (True = attend) over the S cached slots and the Q new
        # False (prefill): skip the LM head where the model allows it; a [K] tensor of the Q
        # positions: their logits alone, [B, K, V], where it allows (else all: [B, Q, V])
        logits: bool | Tensor = True,
        cached: Tensor | None = None,  # [B, S] the cached slots' positions; None: slot_valid's
    ) -> Tensor | None:  # logits [B, Q, V]
        dtype = self.model.dtype

        def additive(allowed: Tensor) -> Tensor:  # [B, Q, S + Q] bool -> [B, 1, Q, S + Q]
            zeros = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
            return zeros.masked_fill(~allowed, torch.finfo(dtype).min)[:, None]

        attention_mask = additive(mask)
        if self.sliding_window is not None:
            if cached is None:
                cached = cache.slot_valid.long().cumsum(1) - 1  # [B, S] (invalid slots: masked)
            keys = torch.cat([cached, positions], dim=1)  # [B, S + Q]
            near = positions[:, :, None] - keys[:, None, :] < self.sliding_window
            attention_mask = {
                "full_attention": attention_mask,
                "sliding_attention": additive(mask & near),
            }
        # transformers' causal LMs take logits_to_keep (1: the last position's only; a tensor:
        # those positions'), which spares a prefill the LM head over every prompt token
        # (Gemma-3's 262k-vocabulary head costs more than its 18 layers).
        keep = {}
        if self.keeps_logits and logits is not True:
            keep = {"logits_to_keep": 1 if logits is False else logits}
        out = self.model(
            input_ids=tokens,
            position_ids=positions,
            attention_mask=attention_mask,
            use_cache=True,
            output_hidden_states=bool(cache.hidden_layers),
            **{self.cache_name: cache.past},
            **keep,
        )
        cache.past = out[self.cache_name]
        cache.hidden = {layer: out.hidden_states[layer] for layer in cache.hidden_layers}
        return None if logits is False else out.logits

    def prefill(
        self, tokens: Tensor, lengths: Tensor, capacity: int, hidden_layers: Sequence[int] = ()
    ) -> HFCache:
        return self._prefill(tokens[:, :-1], lengths - 1, hidden_layers)[0]

    scores_prefill = True

    def prefill_scored(
        self, tokens: Tensor, lengths: Tensor, capacity: int
    ) -> tuple[HFCache, Tensor]:
        return self._prefill(tokens, lengths, (), scored=True)

    def _prefill(
        self,
        prompt: Tensor,  # [B, W] right-padded, the tokens to cache
        lengths: Tensor,  # [B] real tokens of each row among them
        hidden_layers: Sequence[int],
        scored: bool = False,
    ) -> tuple[HFCache, Tensor | None]:  # and with scored each row's last token's logits [B, 1, V]
        from transformers import DynamicCache

        (batch, width), device = prompt.shape, prompt.device
        cache = HFCache(
            past=DynamicCache(),
            slot_valid=torch.zeros(batch, 0, dtype=torch.bool, device=device),
            root_position=lengths,
            pending=prompt.new_zeros(batch, 0),
            pending_valid=torch.zeros(batch, 0, dtype=torch.bool, device=device),
            hidden_layers=tuple(hidden_layers),
        )
        if width == 0:
            return cache, None
        real = torch.arange(width, device=device) < lengths[:, None]
        causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
        # Padding queries attend to themselves only, so no softmax row is empty.
        mask = (causal & real[:, None, :]) | torch.eye(width, dtype=torch.bool, device=device)
        positions = torch.arange(width, device=device).expand(batch, width)
        if not scored:
            self._forward(cache, prompt, positions, mask, logits=False)
            cache.slot_valid = real
            return cache, None
        # The logits of the rows' last positions, each position once where the model keeps
        # some (a host read), else of all
        last = lengths - 1
        kept = last.unique() if self.keeps_logits else None
        logits = self._forward(
            cache, prompt, positions, mask, logits=True if kept is None else kept
        )
        cache.slot_valid = real
        column = last if kept is None else torch.searchsorted(kept, last)
        return cache, logits.gather(1, column.view(-1, 1, 1).expand(-1, 1, logits.shape[2]))

    def score_tree(self, cache: HFCache, tree: DraftTree) -> Tensor:
        if cache.scored:  # a second pass before commit (a drafter growing its tree level by
            cache.past.crop(-cache.scored)  # level): forget the previous one
        batch, n = tree.tokens.shape
        num_pending = cache.pending.shape[1]
        device = tree.tokens.device
        tokens = torch.cat([cache.pending, tree.tokens], dim=1)
        # Pending tokens sit right before the root; their positions count back from it.
        pending_pos = (
            cache.root_position[:, None] - num_pending + torch.arange(num_pending, device=device)
        )
        pending_pos = torch.where(cache.pending_valid, pending_pos, 0)
        ancestors, depth = topology(tree.parents)
        positions = torch.cat([pending_pos, cache.root_position[:, None] + depth], dim=1)
        q = num_pending + n
        mask = torch.zeros(batch, q, cache.slot_valid.shape[1] + q, dtype=torch.bool, device=device)
        mask[:, :, : cache.slot_valid.shape[1]] = cache.slot_valid[:, None, :]
        new = mask[:, :, cache.slot_valid.shape[1] :]
        causal = torch.ones(num_pending, num_pending, dtype=torch.bool, device=device).tril()
        new[:, :num_pending, :num_pending] = causal & cache.pending_valid[:, None, :]
        new[:, num_pending:, :num_pending] = cache.pending_valid[:, None, :]
        new[:, num_pending:, num_pending:] = ancestors
        new |= torch.eye(q, dtype=torch.bool, device=device)  # padding queries see themselves
        logits = self._forward(cache, tokens, positions, mask)
        cache.hidden = {layer: h[:, num_pending:] for layer, h in cache.hidden.items()}
        cache.tree, cache.scored = tree, q
        return logits[:, num_pending:]

    def grow_tree(
        self, cache: HFCache, tokens: Tensor, parents: Tensor, needed: Tensor | None = None
    ) -> Tensor:
        if not cache.scored:  # the first grow is an ordinary tree under the committed root
            return self.score_tree(cache, DraftTree(tokens=tokens, parents=parents))
        tree = grown(cache.tree, tokens, parents)
        m, device = tokens.shape[1], tokens.device
        ancestors, depth = topology(tree.parents)
        num_pending = cache.pending.shape[1]
        pending_pos = (
            cache.root_position[:, None] - num_pending + torch.arange(num_pending, device=device)
        )
        # The cached slots: committed, pending, then the tree's earlier nodes.
        cached = torch.cat(
            [
                cache.slot_valid.long().cumsum(1) - 1,
                torch.where(cache.pending_valid, pending_pos, 0),
                cache.root_position[:, None] + depth[:, :-m],
            ],
            dim=1,
        )
        mask = torch.cat(
            [
                cache.slot_valid[:, None, :].expand(-1, m, -1),
                cache.pending_valid[:, None, :].expand(-1, m, -1),
                ancestors[:, -m:],
            ],
            dim=2,
        )  # [B, M, S + P + N]
        positions = cache.root_position[:, None] + depth[:, -m:]
        logits = self._forward(cache, tokens, positions, mask, cached=cached)
        cache.tree, cache.scored = tree, cache.scored + m
        return logits

    def commit(self, cache: HFCache, nodes: Tensor, counts: Tensor) -> None:
        # Keep the pending slots and the root's slot; drop the rest of the tree.
        cache.past.crop(-(cache.tree.num_nodes - 1))
        cache.scored = 0
        cache.slot_valid = torch.cat(
            [cache.slot_valid, cache.pending_valid, (counts > 0)[:, None]], dim=1
        )
        # The kept nodes after the root become the next pending prefix, left-padded to the
        # longest kept path (the loop trims nodes to it).
        width = nodes.shape[1] - 1
        keep = (counts - 1).clamp_min(0)
        source = torch.arange(width, device=nodes.device) - (width - keep)[:, None]  # [B, P]
        accepted = cache.tree.tokens.gather(1, nodes[:, 1:])
        cache.pending_valid = source >= 0
        cache.pending = torch.where(cache.pending_valid, accepted.gather(1, source.clamp_min(0)), 0)
        cache.root_position = cache.root_position + counts


@dataclass
class NativeCache:
    """Cache handle of a NativeTarget: the model's StaticKVCache plus a host-side bound on the
    longest row, so the cache can grow before a pass would overflow it without a host sync."""

    kv: Any  # genrec_spec.models.llm.kv_cache.StaticKVCache
    length_bound: int
    hidden_layers: tuple[int, ...] = ()
    hidden: dict[int, Tensor] = field(default_factory=dict)


class NativeTarget:
    """The project's Llama (``genrec_spec.models.llm.llama``): one tree-masked forward through the
    kernels' tree attention; commit appends the kept path's pending K/V to the static cache."""

    def __init__(self, model: Any) -> None:
        self.model = model.eval()
        self.device = model.tok_embeddings.weight.device
        self.vocab_size = model.config.vocab_size
        self.max_length = model.config.max_seq_len

    def _forward(
        self, cache: NativeCache, tokens: Tensor, parents: Tensor | None, grow: bool = False
    ) -> Tensor:
        # tokens [B, N], parents [B, N] or None (a chain) -> logits [B, N, V]
        pending = cache.kv.pending[1] if grow and cache.kv.pending is not None else 0
        needed = cache.length_bound + pending + tokens.shape[1]
        # A grown tree (beam search) keeps every node the search scored, so its slots may
        # outnumber max_length, while beam search keeps its nodes' positions within it; a tree
        # scored in one pass stays within max_length slots, which bounds its positions too.
        cache.kv.reserve(needed, 2 * needed if grow else self.max_length)
        # Only the Llama itself grows trees; its wrappers (early exit, the 4-bit draft) score
        # ordinary passes and take no such argument.
        growing = {"grow": True} if grow else {}
        out = self.model(tokens, cache.kv, parents, hidden_layers=cache.hidden_layers, **growing)
        logits, cache.hidden = out if cache.hidden_layers else (out, {})
        return logits

    def prefill(
        self, tokens: Tensor, lengths: Tensor, capacity: int, hidden_layers: Sequence[int] = ()
    ) -> NativeCache:
        width = tokens.shape[1] - 1
        cache = self._new_cache(tokens.shape[0], width, capacity, hidden_layers)
        if width > 0:  # the prompt's logits are never read: no LM head
            cache.hidden = self.model.encode(
                tokens[:, :width], cache.kv, hidden_layers=cache.hidden_layers
            )
            self._commit_prompt(cache, lengths - 1)
        return cache

    @property
    def scores_prefill(self) -> bool:
        # The Llama does; its wrappers (an early exit) only serve as drafts.
        return hasattr(self.model, "encode_last")

    def prefill_scored(
        self, tokens: Tensor, lengths: Tensor, capacity: int
    ) -> tuple[NativeCache, Tensor]:
        cache = self._new_cache(tokens.shape[0], tokens.shape[1], capacity, ())
        logits = self.model.encode_last(tokens, cache.kv, lengths)  # [B, 1, V]
        self._commit_prompt(cache, lengths)
        return cache, logits

    def _new_cache(
        self, batch: int, width: int, capacity: int, hidden_layers: Sequence[int]
    ) -> NativeCache:
        """An empty cache with room for a prompt of width tokens and a decode of capacity."""
        # Room for the committed tokens plus a modest tree; _forward grows it for bigger trees.
        size = min(capacity + 64, self.max_length)
        cache = NativeCache(
            kv=self.model.new_cache(batch, size),
            length_bound=width,
            hidden_layers=tuple(hidden_layers),
        )
        cache.kv.reserve(width, self.max_length)
        return cache

    def _commit_prompt(self, cache: NativeCache, lengths: Tensor) -> None:
        """Keep the first lengths[b] of the pending prompt tokens of each row."""
        batch, width = lengths.shape[0], cache.length_bound
        cache.kv.commit(torch.arange(width, device=lengths.device).expand(batch, width), lengths)

    def score_tree(self, cache: NativeCache, tree: DraftTree) -> Tensor:
        return self._forward(cache, tree.tokens, tree.parents)

    def grow_tree(
        self, cache: NativeCache, tokens: Tensor, parents: Tensor, needed: Tensor | None = None
    ) -> Tensor:
        return self._forward(cache, tokens, parents, grow=True)

    def commit(self, cache: NativeCache, nodes: Tensor, counts: Tensor) -> None:
        cache.kv.commit(nodes, counts)
        cache.length_bound += nodes.shape[1]


def as_target(model: Any) -> Target:
    """Wrap a model in its adapter: targets pass through, the project's Llama becomes a
    NativeTarget, a transformers model an HFTarget. Plain callables need
    ``CallableTarget(fn)`` explicitly (they promise causality)."""
    if hasattr(model, "score_tree"):
        return model
    from genrec_spec.models.llm.llama import Llama

    if isinstance(model, Llama):
        return NativeTarget(model)
    if hasattr(model, "config") and hasattr(model, "get_output_embeddings"):
        return HFTarget(model)
    raise DecodeInputError(
        f"cannot use a {type(model).__name__} as a target",
        "pass a Target, a genrec_spec Llama, a transformers causal LM, or wrap a causal "
        "ids -> logits callable in genrec_spec.CallableTarget(fn)",
    )
