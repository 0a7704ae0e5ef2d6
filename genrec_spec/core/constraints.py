"""Constraints: which tokens may follow a prefix, for greedy, sampling and beam search alike.

A constraint keeps one integer *state* per prefix (for a catalogue, the prefix's trie node), so
the decoding loop can carry it along a tree without replaying prefixes:

    states = constraint.start(batch)               # [B] the empty generated prefix of each row
    states = constraint.advance(states, tokens)    # [...] one token further (-1: left it)
    allowed = constraint.allowed(states, rows, sequences)  # [Q, V] bool

``sequences`` is a callable giving each queried prefix as a full token list (prompt and generated
tokens), built only for constraints that read it (``AllowedTokens``, the transformers hook).

Two implementations: ``Catalogue`` (a ``TokenTrie`` of item sequences: its forced continuations
are drafts that cannot miss) and ``AllowedTokens`` (transformers' ``prefix_allowed_tokens_fn``).
``log_probs`` turns logits into a constrained distribution by one of the two scoring rules.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from numbers import Integral
from typing import Protocol

import torch
from torch import Tensor

from genrec_spec.core.catalogue import TokenTrie
from genrec_spec.core.tree import paths, topology
from genrec_spec.core.types import DecodeInputError

Sequences = Callable[[], list[list[int]]]


class Constraint(Protocol):
    def start(self, batch: int, device: torch.device | str = "cpu") -> Tensor: ...

    def advance(self, states: Tensor, tokens: Tensor) -> Tensor: ...

    def allowed(self, states: Tensor, rows: Tensor, sequences: Sequences) -> Tensor: ...


class Catalogue:
    """Generation restricted to the catalogue's sequences; states are trie nodes."""

    def __init__(self, trie: TokenTrie, items_below: Tensor | None = None) -> None:
        self.trie = trie
        self.vocab_size = trie.vocab_size
        # [nodes] catalogue items under each node
        self.items_below = _items_below(trie) if items_below is None else items_below

    def to(self, device: torch.device | str) -> Catalogue:
        """The catalogue with its tables on `device`: itself where they are there already (every
        search moves its catalogue, so a catalogue kept on its target's device costs nothing)."""
        if self.items_below.device == torch.device(device):
            return self
        return Catalogue(self.trie.to(device), self.items_below.to(device))

    @classmethod
    def of(
        cls, sequences: Sequence[Sequence[int]], vocab_size: int, eos_token_id: int | None = None
    ) -> Catalogue:
        return cls(TokenTrie.from_sequences(sequences, vocab_size, eos_token_id))

    def start(self, batch: int, device: torch.device | str = "cpu") -> Tensor:  # [B]
        return torch.zeros(batch, dtype=torch.long, device=device)

    def advance(self, states: Tensor, tokens: Tensor) -> Tensor:  # [...], [...] -> [...]
        return self.trie.step(states, tokens)

    def allowed(self, states: Tensor, rows: Tensor, sequences: Sequences) -> Tensor:
        return self.trie.allowed(states)  # [Q, V]

    def items_of(self, values: Tensor, offsets: Tensor) -> Tensor:  # [R] int64
        """The item each of R ragged token rows (values, offsets [R + 1]: a decoder's output)
        is: its trie leaf's, the first of items sharing the sequence; -1 for a row that is not
        a whole catalogue sequence."""
        lengths = offsets.diff()  # [R]
        nodes = self.start(len(lengths), values.device)
        longest = int(lengths.max()) if len(lengths) else 0
        column = torch.arange(longest, device=values.device)  # [T]
        inside = column < lengths[:, None]  # [R, T]
        # [R, T] each row's tokens (past its end: any token, masked below)
        tokens = values[(offsets[:-1, None] + column).clamp(max=max(len(values) - 1, 0))]
        for j in range(longest):
            nodes = torch.where(inside[:, j], self.advance(nodes, tokens[:, j]), nodes)
        return self.trie.items(nodes)


class AllowedTokens:
    """transformers' ``prefix_allowed_tokens_fn(batch_id, input_ids) -> list[int]`` as a
    constraint: called once per queried prefix with the row and the prefix's full sequence."""

    def __init__(self, fn: Callable[[int, Tensor], Sequence[int]], vocab_size: int) -> None:
        self.fn = fn
        self.vocab_size = vocab_size

    def start(self, batch: int, device: torch.device | str = "cpu") -> Tensor:  # [B]
        return torch.zeros(batch, dtype=torch.long, device=device)

    def advance(self, states: Tensor, tokens: Tensor) -> Tensor:  # the hook keeps no state
        return states

    def allowed(self, states: Tensor, rows: Tensor, sequences: Sequences) -> Tensor:
        # Built on the host, where the hook's lists are, then moved to the states' device
        mask = torch.zeros(len(rows), self.vocab_size, dtype=torch.bool, device="cpu")
        for i, (row, sequence) in enumerate(zip(rows.tolist(), sequences(), strict=True)):
            tokens = list(self.fn(row, torch.tensor(sequence, device="cpu")))
            if not tokens:
                raise DecodeInputError(
                    f"prefix_allowed_tokens_fn returned no token for row {row} after "
                    f"{len(sequence)} tokens: the constraint cannot be satisfied",
                    "return at least one allowed token for every prefix",
                )
            # (checked as one tensor: a hook may allow most of a 49k vocabulary per prefix)
            ids = torch.as_tensor(tokens, device="cpu")
            if (
                ids.is_floating_point()
                or ids.dtype == torch.bool
                or bool(((ids < 0) | (ids >= self.vocab_size)).any())
            ):
                bad = next(t for t in tokens if not _is_token(t, self.vocab_size))
                raise DecodeInputError(
                    f"prefix_allowed_tokens_fn returned {bad!r} for row {row}, not a token id "
                    f"of the vocabulary of {self.vocab_size}",
                    "return token ids from 0 to vocab_size - 1",
                )
            mask[i, ids] = True
        return mask.to(states.device)


def _is_token(value, vocab_size: int) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool) and 0 <= value < vocab_size


def _items_below(trie: TokenTrie) -> Tensor:  # [nodes] int64
    """How many catalogue items each node's subtree ends, summed a depth at a time upwards."""
    parent = torch.full((trie.num_nodes,), -1, dtype=torch.long)
    parent[1:] = trie.edge_keys // trie.vocab_size  # node e + 1's edge key: parent * V + token
    depth = torch.zeros(trie.num_nodes, dtype=torch.long)
    for _ in range(trie.longest):  # a node's depth is its parent's + 1
        depth = torch.where(parent >= 0, depth[parent.clamp_min(0)] + 1, 0)
    below = (trie.leaf_items >= 0).long()
    for level in range(trie.longest, 0, -1):
        at = depth == level
        below.index_add_(0, parent[at], below[at])
    return below


def check_catalogue(
    constraint: Constraint | None,
    eos: list[int],
    max_new_tokens: int,
    vocab_size: int | None,  # the target's (None: not known before its prefill)
) -> None:
    """A catalogue needs the end token (an item is finished there) and no item with an end token
    inside it, or items of one length that max_new_tokens ends (Semantic IDs); room for its
    longest sequence; and tokens the target has: otherwise a row could stop or run on outside
    the catalogue, or read past the target's outputs."""
    if not isinstance(constraint, Catalogue):
        return
    trie = constraint.trie
    if vocab_size is not None and trie.largest_token >= vocab_size:
        raise DecodeInputError(
            f"the catalogue holds token {trie.largest_token}, outside the target's vocabulary "
            f"of {vocab_size}",
            "build the catalogue with the target's own tokenizer and vocabulary size",
        )
    inside = [e for e in eos if 0 <= e < trie.vocab_size and bool(trie.inner_tokens[e])]
    if inside:
        raise DecodeInputError(
            f"end token {inside[0]} stands inside a catalogue item: a search would stop there, "
            "on no item",
            "drop end tokens from inside the items' sequences (only an item's last token)",
        )
    longest = trie.longest
    if not eos and not trie.shortest == longest == max_new_tokens:
        raise DecodeInputError(
            "a catalogue constraint needs eos_token_id (an item is finished at its end token) "
            f"unless its items all have max_new_tokens tokens (they have "
            f"{trie.shortest}..{longest}; max_new_tokens = {max_new_tokens})",
            "pass the token every catalogue sequence ends with as eos_token_id",
        )
    if max_new_tokens < longest:
        raise DecodeInputError(
            f"max_new_tokens = {max_new_tokens} is shorter than the catalogue's longest "
            f"sequence ({longest} tokens): a row cut there would be no item",
            f"pass max_new_tokens >= {longest}",
        )


def log_probs(
    logits: Tensor,  # [Q, V]
    allowed: Tensor | None,  # [Q, V] bool, None: no constraint
    renormalize: bool = False,
    normalized: bool = False,  # the logits are log-probabilities already
) -> Tensor:  # [Q, V] float32, -inf at disallowed tokens
    """Next-token log-probabilities under a constraint, by one of two rules: the full
    vocabulary's log-probabilities masked to the allowed tokens (transformers' rule, whose beam
    scores are then comparable to an unconstrained model's), or, with ``renormalize``, the
    distribution renormalised over the allowed tokens (a forced token costs exactly 0). A prefix
    with no allowed token (a finished catalogue item) gets -inf everywhere under both.
    ``normalized`` logits (a target whose outputs are log-probs: the recommender) are masked as
    they are under the first rule, so the scores are the target's own, bit for bit."""
    logits = logits.float()
    if normalized and not renormalize:
        return logits if allowed is None else logits.masked_fill(~allowed, float("-inf"))
    if allowed is None:
        return torch.log_softmax(logits, dim=-1)
    if renormalize:
        masked = torch.log_softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1)
        return masked.masked_fill(~allowed, float("-inf"))  # also the NaN of empty rows
    return torch.log_softmax(logits, dim=-1).masked_fill(~allowed, float("-inf"))


def catalogue_log_probs(
    logits: Tensor,  # [N, V]
    trie: TokenTrie,
    states: Tensor,  # [Q] trie nodes
    renormalize: bool = False,
    normalized: bool = False,
    at: Tensor | None = None,  # [Q] each state's row of the logits (None: row q, N = Q)
) -> tuple[Tensor, Tensor, Tensor]:  # values [Q, C] float32 (-inf pads), tokens, nodes [Q, C]
    """``log_probs`` under a catalogue, for each node's children only (C the most children of
    any of the nodes): the same values at the allowed tokens, without a [Q, V] mask, so a
    search reads C candidates per node instead of V. Also each child's node (-1 pads): the
    state a search carries along a chosen token without stepping down the trie again."""
    tokens, children, exists = trie.children_of(states)  # [Q, C] each
    missing = ~exists
    if not (normalized or renormalize):  # the full vocabulary's log-probs, then the children's
        logits = torch.log_softmax((logits if at is None else logits[at]).float(), dim=-1)
        at = None
    # the children's logits alone, read in place: no [Q, V] copy of the nodes' rows
    picked = logits.gather(1, tokens) if at is None else logits[at[:, None], tokens]
    values = picked.float().masked_fill(missing, float("-inf"))
    if renormalize:
        values = torch.log_softmax(values, dim=-1).masked_fill(missing, float("-inf"))
    return values, tokens, children


class ConstrainedTrees:
    """A constraint applied to ``generate``'s draft trees: each row's state after its generated
    tokens, each tree node's state along its path, and the target's logits masked to the
    allowed tokens of every node (so greedy picks the best allowed token and sampling draws from
    the constrained distribution, renormalised by the softmax). A node whose prefix left the
    constraint, or allows nothing (a finished item), keeps its logits: no accepted path reaches
    past it, since its parent gave its token probability 0 or it ends the row."""

    def __init__(self, constraint: Constraint, batch: int, device: torch.device | str) -> None:
        self.constraint = constraint
        self.states = constraint.start(batch, device)  # [B] after each row's generated tokens

    def mask(self, tree, logits: Tensor, tokens: Tensor, lengths: Tensor) -> Tensor:
        """tree: the scored DraftTree [B, N]; logits [B, N, V]; tokens [B, T] and lengths [B]
        the rows' committed tokens (root included). Returns the masked logits."""
        batch, n = tree.tokens.shape
        states = self.states[:, None].repeat(1, n)  # [B, N], node 0 the row's own state
        for i in range(1, n):  # parents come first: one batched step per node
            above = states.gather(1, tree.parents[:, i : i + 1]).squeeze(1)
            states[:, i] = self.constraint.advance(above, tree.tokens[:, i])
        flat = states.flatten()  # [B * N]
        rows = torch.arange(batch, device=flat.device).repeat_interleave(n)

        def sequences() -> list[list[int]]:
            ancestors, depth = topology(tree.parents, validate=False)
            path = paths(ancestors, depth).tolist()
            prefix = [row[:n] for row, n in zip(tokens.tolist(), lengths.tolist(), strict=True)]
            nodes = tree.tokens.tolist()
            return [
                prefix[b] + [nodes[b][j] for j in path[b][i][1:] if j >= 0]
                for b in range(batch)
                for i in range(n)
            ]

        allowed = self.constraint.allowed(flat, rows, sequences).view(batch, n, -1)
        keep = ~allowed.any(-1, keepdim=True)  # nothing allowed: leave the logits alone
        return logits.masked_fill(~(allowed | keep), float("-inf"))

    def advance(self, emitted: Tensor, counts: Tensor) -> None:
        """Move each row's state over its emitted tokens: emitted [B, M], counts [B]."""
        for j in range(emitted.shape[1]):
            moved = self.constraint.advance(self.states, emitted[:, j])
            self.states = torch.where(j < counts, moved, self.states)
