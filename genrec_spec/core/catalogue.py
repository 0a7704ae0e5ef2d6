"""A catalogue as a prefix trie of token sequences: the items a decoder may emit.

Each item is a token sequence (an item's title tokenised by an LLM's tokenizer, or its Semantic
ID) ending in an end token, so no item is a strict prefix of another and a finished sequence is
exactly one item. Decoding under the catalogue (``constraints.Catalogue``) allows at every node
only the tokens of the node's children; a node with one child has a forced continuation, which
a drafter proposes for free.

Layout (CSR, children sorted by token): nodes are numbered breadth-first, node 0 the root (the
empty sequence), each node's children in token order; node n's children are the edges
``child_offsets[n] .. child_offsets[n + 1]``, edge e carrying ``child_tokens[e]`` to node e + 1
(so the nodes of a catalogue of Semantic IDs are its recommender trie's, ``data_pipelines.trie``).
``edge_keys[e] = parent * V + token`` is sorted, so a (node, token) step is one ``searchsorted``
for a whole batch. The tables a search reads by node have one entry more, the last, which node
-1 (no node: a prefix that left the catalogue, or an empty beam) reads as torch reads index -1:
no children, nothing forced, so no lookup needs a mask.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import torch
from torch import Tensor

from genrec_spec.core.types import DecodeInputError


@dataclass(frozen=True)
class TokenTrie:
    """The trie of a catalogue's token sequences (module docstring for the layout)."""

    vocab_size: int  # V
    child_offsets: Tensor  # [nodes + 1] int64 (node -1 reads the end: past every edge)
    child_counts: Tensor  # [nodes + 1] int64 each node's children (node -1: none)
    child_tokens: Tensor  # [edges] int64 (edge e leads to node e + 1)
    edge_keys: Tensor  # [edges] int64, parent * V + token, ascending
    leaf_items: Tensor  # [nodes] int64: the item a finished sequence is; -1 elsewhere
    # [nodes + 1] int64: the one token a node with exactly one child allows; -1 elsewhere (a
    # search asks it of every step's beams: one read, not the CSR arithmetic)
    forced_tokens: Tensor
    forced_children: Tensor  # [nodes + 1] int64: the node that token leads to; -1 elsewhere
    # [V] bool: the tokens some item has before its end (an end token must not be one)
    inner_tokens: Tensor
    num_items: int  # distinct sequences (items with identical sequences count once)
    longest: int  # tokens in the longest sequence (end token included)
    shortest: int  # tokens in the shortest
    widest: int  # the most children a node has (allowed tokens after any prefix)
    largest_token: int  # a target's vocabulary must hold it

    @classmethod
    def from_sequences(
        cls,
        sequences: Sequence[Sequence[int]],
        vocab_size: int,
        eos_token_id: int | None = None,
    ) -> TokenTrie:
        """The trie of ``sequences`` (item i is sequences[i]); ``eos_token_id`` is appended to
        every sequence not ending in it. Two items with the same sequence share a leaf, which
        names the first. Raises on an empty catalogue, an empty sequence, tokens outside
        [0, vocab_size), or a sequence that is a strict prefix of another (give every sequence
        an end token)."""
        if not sequences:
            raise DecodeInputError("the catalogue is empty", "give at least one item sequence")
        children: list[dict[int, int]] = [{}]
        leaf: dict[int, int] = {}
        longest, shortest = 0, 1 << 62
        for item, sequence in enumerate(sequences):
            tokens = list(sequence)
            if eos_token_id is not None and (not tokens or tokens[-1] != eos_token_id):
                tokens.append(eos_token_id)
            _check_tokens(item, tokens, vocab_size, eos_token_id)
            longest, shortest = max(longest, len(tokens)), min(shortest, len(tokens))
            node = 0
            for token in tokens:
                if node in leaf:
                    raise _prefix_error(item)
                nxt = children[node].get(token)
                if nxt is None:
                    nxt = children[node][token] = len(children)
                    children.append({})
                node = nxt
            if children[node]:
                raise _prefix_error(item)
            leaf.setdefault(node, item)
        # Breadth-first, each node's children in token order (the module docstring's layout)
        ordered = [sorted(children[0].items())]  # [(token, built node)] of each node, in order
        built = [0]  # each node's number as built
        for node_children in ordered:  # (grows as it goes: the children's, after the parents')
            built.extend(child for _, child in node_children)
            ordered.extend(sorted(children[child].items()) for _, child in node_children)
        number = {node: place for place, node in enumerate(built)}
        return cls.from_layout(
            vocab_size,
            torch.tensor([len(c) for c in ordered], dtype=torch.long),
            torch.tensor([t for c in ordered for t, _ in c], dtype=torch.long),
            torch.tensor([number[node] for node in leaf], dtype=torch.long),
            torch.tensor(list(leaf.values()), dtype=torch.long),
            longest,
            shortest,
        )

    @classmethod
    def from_layout(
        cls,
        vocab_size: int,
        counts: Tensor,  # [nodes] int64 each node's children, nodes in the module's order
        tokens: Tensor,  # [edges] int64 the token edge e carries to node e + 1
        leaves: Tensor,  # [I] int64 the nodes that end a sequence
        items: Tensor,  # [I] int64 the item each names
        longest: int,  # tokens in the longest sequence
        shortest: int,  # and in the shortest
    ) -> TokenTrie:
        """The trie laid out as the module docstring says (``from_sequences`` builds the layout
        from token lists; a recommender takes its item trie's, `recsys.target`)."""
        on = counts.device  # (the tables are made where the layout is)
        offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
        parents = torch.repeat_interleave(torch.arange(len(counts), device=on), counts)
        leaf_items = torch.full((len(counts),), -1, dtype=torch.long, device=on)
        leaf_items[leaves] = items
        first = offsets[:-1].clamp(max=len(tokens) - 1)  # a leaf's lies past the last edge
        forced = counts == 1
        none = torch.full((1,), -1, dtype=torch.long, device=on)  # what node -1 reads (above)
        inner = torch.zeros(vocab_size, dtype=torch.bool, device=on)
        inner[tokens[counts[1:] > 0]] = True  # the tokens of edges into non-leaf nodes
        return cls(
            vocab_size=vocab_size,
            child_offsets=offsets,
            child_counts=torch.cat([counts, torch.zeros_like(none)]),
            child_tokens=tokens,
            edge_keys=parents * vocab_size + tokens,
            leaf_items=leaf_items,
            forced_tokens=torch.cat([torch.where(forced, tokens[first], -1), none]),
            forced_children=torch.cat([torch.where(forced, first + 1, -1), none]),
            inner_tokens=inner,
            num_items=len(leaves),
            longest=longest,
            shortest=shortest,
            widest=int(counts.max()),
            largest_token=int(tokens.max()),
        )

    @property
    def num_nodes(self) -> int:
        return len(self.child_offsets) - 1

    def step(self, nodes: Tensor, tokens: Tensor) -> Tensor:  # [...], [...] -> [...] int64
        """The child of each node along each token; -1 where the token leaves the catalogue
        (or the node is -1 already)."""
        keys = nodes * self.vocab_size + tokens  # a -1 node's are negative: no edge's
        edge = torch.searchsorted(self.edge_keys, keys.flatten()).view(keys.shape)
        edge = edge.clamp(max=len(self.edge_keys) - 1)
        return torch.where(self.edge_keys[edge] == keys, edge + 1, -1)

    def children_of(self, nodes: Tensor) -> tuple[Tensor, Tensor, Tensor]:  # [...] -> [..., C]
        """Each node's child tokens in token order, C the most any of them has (at least 1),
        the nodes they lead to (-1 pads) and which of the C slots hold one (-1 nodes have
        none)."""
        edges, exists = self.child_edges(nodes)
        missing = ~exists
        tokens = self.child_tokens[edges].masked_fill(missing, 0)
        return tokens, (edges + 1).masked_fill(missing, -1), exists

    def child_edges(self, nodes: Tensor) -> tuple[Tensor, Tensor]:  # [...] -> 2 x [..., C]
        """``children_of``'s edges (a child's token is ``child_tokens[e]``, its node e + 1),
        any edge in the slots that hold none, and which slots hold one."""
        first, counts = self.child_offsets[nodes], self.child_counts[nodes]  # [...] each
        most = max(1, int(counts.max())) if nodes.numel() else 1
        slots = torch.arange(most, device=nodes.device)
        exists = slots < counts[..., None]  # [..., C]
        return (first[..., None] + slots).clamp(max=max(len(self.child_tokens) - 1, 0)), exists

    def allowed(self, nodes: Tensor) -> Tensor:  # [Q] -> [Q, V] bool
        """The tokens each node lets through (its children's); none for -1."""
        tokens, _, exists = self.children_of(nodes)  # [Q, C] each
        at, slot = exists.nonzero(as_tuple=True)
        mask = torch.zeros(len(nodes), self.vocab_size, dtype=torch.bool, device=nodes.device)
        mask[at, tokens[at, slot]] = True
        return mask

    def forced(self, nodes: Tensor) -> Tensor:  # [...] -> [...] int64
        """The one token a node allows, where it has exactly one child; -1 elsewhere."""
        return self.forced_tokens[nodes]

    def forced_child(self, nodes: Tensor) -> Tensor:  # [...] -> [...] int64
        """The node that token leads to, where a node has exactly one child; -1 elsewhere."""
        return self.forced_children[nodes]

    def to(self, device: torch.device | str) -> TokenTrie:
        """The trie with its tables on `device`."""
        tables = {f.name: getattr(self, f.name) for f in fields(self)}
        moved = {n: t.to(device) for n, t in tables.items() if isinstance(t, Tensor)}
        return replace(self, **moved)

    def items(self, nodes: Tensor) -> Tensor:  # [...] -> [...] int64
        """The item each finished node is; -1 for nodes that end no sequence."""
        return torch.where(nodes >= 0, self.leaf_items[nodes.clamp_min(0)], -1)


def _check_tokens(item: int, tokens: list[int], vocab_size: int, eos: int | None) -> None:
    if not tokens:
        raise DecodeInputError(
            f"catalogue item {item} has an empty token sequence",
            "give every item at least one token (or pass eos_token_id)",
        )
    if eos is not None and eos in tokens[:-1]:
        raise DecodeInputError(
            f"catalogue item {item} has the end token {eos} before its end: a search would "
            "stop there, on no item",
            "drop the end token from inside the item's sequence (only its last token may be it)",
        )
    bad = [t for t in tokens if not 0 <= t < vocab_size]
    if bad:
        raise DecodeInputError(
            f"catalogue item {item} has token {bad[0]} outside the vocabulary of {vocab_size}",
            "tokenise the catalogue with the model's own tokenizer",
        )


def _prefix_error(item: int) -> DecodeInputError:
    return DecodeInputError(
        f"catalogue item {item} and another item are one a strict prefix of the other",
        "end every sequence with an end token (pass eos_token_id)",
    )
