"""The scored tree of a beam search: per row, every node scored so far, each node's constraint
state and the best next-token log-probabilities at it.

Rows share one node numbering, the target's pending tree (``Target.grow_tree``): a pass adds
the same number of nodes M to every row, rows with fewer real nodes padding with nodes no beam
reaches. Node 0 of every row is its root, the prompt's last token. The host-side part (which
child a (parent, token) pair is, each node's path) is plain Python: a step looks up a few beams
per row, and drafting walks a few nodes per beam.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

# A node to add: (parent node, token, constraint state); the parent may be a node added earlier
# in the same plan (nodes are numbered in the order they are planned).
Planned = tuple[int, int, int]


@dataclass
class BeamTree:
    """Scored nodes of B rows (module docstring)."""

    batch: int
    width: int  # C: best next-token candidates kept per node
    size: int = 0  # nodes per row (real and padding)
    parents: list[list[int]] = field(default_factory=list)  # [B][size], -1 for roots
    tokens: list[list[int]] = field(default_factory=list)  # [B][size]
    states: list[list[int]] = field(default_factory=list)  # [B][size] constraint states
    children: list[dict[tuple[int, int], int]] = field(default_factory=list)  # (parent, token)
    # [B, capacity, C] log-probs (best first; -inf pads) and tokens of the first `size` nodes;
    # the capacity doubles when full, so a pass copies only its own nodes.
    top_values: Tensor | None = None
    top_tokens: Tensor | None = None

    def __post_init__(self) -> None:
        self.parents = [[] for _ in range(self.batch)]
        self.tokens = [[] for _ in range(self.batch)]
        self.states = [[] for _ in range(self.batch)]
        self.children = [{} for _ in range(self.batch)]

    def child(self, row: int, parent: int, token: int) -> int:
        """The node (parent, token) leads to; -1 when it is not scored (nor planned)."""
        return self.children[row].get((parent, token), -1)

    def path(self, row: int, node: int) -> list[int]:
        """Tokens from the root (excluded) down to node (included)."""
        out = []
        while self.parents[row][node] >= 0:
            out.append(self.tokens[row][node])
            node = self.parents[row][node]
        return out[::-1]

    def add(self, row: int, plan: list[Planned], parent: int, token: int, state: int) -> int:
        """Plan one node of ``row`` for the next pass; returns the number it will have."""
        node = self.size + len(plan)
        plan.append((parent, token, state))
        self.children[row][(parent, token)] = node
        return node

    def plan(self, plans: list[list[Planned]]) -> tuple[Tensor, Tensor, Tensor]:
        """Append the planned nodes of every row (numbered by ``add``) and pad the rows to one
        count M. Returns tokens, parents [B, M] for the target and real [B, M] bool."""
        m = max(len(p) for p in plans)
        for row, nodes in enumerate(plans):
            padded = nodes + [(-1, 0, -1)] * (m - len(nodes))
            self.parents[row] += [parent for parent, _, _ in padded]
            self.tokens[row] += [token for _, token, _ in padded]
            self.states[row] += [state for _, _, state in padded]
        tokens = torch.tensor([t[self.size :] for t in self.tokens], dtype=torch.long)
        parents = torch.tensor([p[self.size :] for p in self.parents], dtype=torch.long)
        real = torch.arange(m) < torch.tensor([len(p) for p in plans])[:, None]  # [B, M]
        self.size += m
        return tokens.view(self.batch, m), parents.view(self.batch, m), real

    def store(self, values: Tensor, tokens: Tensor) -> None:
        """Store the last planned nodes' best candidates: values, tokens [B, M, C]."""
        start = self.size - values.shape[1]
        if self.top_values is None or self.top_values.shape[1] < self.size:
            capacity = max(self.size, 2 * (0 if self.top_values is None else start))
            grown_values = values.new_full((self.batch, capacity, self.width), float("-inf"))
            grown_tokens = tokens.new_zeros(self.batch, capacity, self.width)
            if start:
                grown_values[:, :start] = self.top_values[:, :start]
                grown_tokens[:, :start] = self.top_tokens[:, :start]
            self.top_values, self.top_tokens = grown_values, grown_tokens
        self.top_values[:, start : self.size] = values
        self.top_tokens[:, start : self.size] = tokens

    def candidates(self, nodes: Tensor) -> tuple[Tensor, Tensor]:  # [B, W] -> 2 x [B, W, C]
        """The stored candidates (log-probs, tokens) of each beam's node."""
        index = nodes.clamp_min(0)[..., None].expand(-1, -1, self.width)
        return self.top_values.gather(1, index), self.top_tokens.gather(1, index)
