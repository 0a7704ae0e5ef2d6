"""The scored tree of a beam search: per row, every node scored or planned so far, each node's
constraint state and the best next-token log-probabilities at it.

Rows share one node numbering, the target's pending tree (``Target.grow_tree``): a pass adds
the same number of nodes M to every row, rows with fewer real nodes padding with nodes no beam
reaches (parent -1, state -1). Node 0 of every row is its root, the prompt's last token. All
bookkeeping is batched tensor work: a (row, parent, token) triple is one int64 key, and the keys
of every node are sorted when a lookup needs them (plain beam search never looks a node up: a
beam's new node is always new), so looking up the children of a whole step's beams (or a
draft's nodes) is one ``searchsorted``.

A pass is planned with ``add`` (nodes get their numbers at once, so a planned node can be the
parent of another: a drafter plans below the beams' new nodes; each node's constraint state is
its parent's advanced by its token, a root's the row's start), then ``plan`` closes it and gives
the target its nodes, and ``store`` keeps their best candidates once scored. A node whose
candidates need no target (``know``: a forced token that costs nothing) can wait planned until
a pass carries it as the parent of nodes that do.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from genrec_spec.core.constraints import Constraint

# Node numbers per row are below this, so (row, parent, token) packs into one int64 key.
MAX_NODES = 1 << 24


@dataclass
class BeamTree:
    """Scored and planned nodes of B rows (module docstring)."""

    batch: int
    width: int  # C: best next-token candidates kept per node
    vocab_size: int  # tokens (generated and prompt) are below this: keys pack them
    # Node slots per row to start with (all padding); more are added by doubling, which copies
    # every table, so a search sizes this to the nodes it expects.
    capacity: int = 1
    device: torch.device | str = "cpu"  # the target's: every table lives beside its outputs
    constraint: Constraint | None = None  # the search's: each node's state under it
    # The deepest node a beam reaches (the search's max_new_tokens; the root is depth 0): a
    # drafter plans nothing below it, whose outputs no beam reads and whose positions may lie
    # past the target's context (a catalogue's or the recommender's drafts end above it)
    max_depth: int = MAX_NODES
    size: int = 0  # nodes per row in closed passes (real and padding)
    pending: Tensor = field(init=False)  # [B] nodes planned per row for the next pass
    parents: Tensor = field(init=False)  # [B, capacity] -1 for roots and padding
    tokens: Tensor = field(init=False)  # [B, capacity]
    states: Tensor = field(init=False)  # [B, capacity] constraint states (-1 padding)
    start: Tensor = field(init=False)  # [B] each row's root state (zeros without a constraint)
    keys: Tensor = field(init=False)  # [R] sorted keys of the real nodes added before `unsorted`
    key_nodes: Tensor = field(init=False)  # [R] the node each key names
    # (rows, parents, tokens, nodes) of each `add` since the keys were last sorted
    unsorted: list = field(init=False, default_factory=list)
    # (rows, nodes) of each `add` since the last pass was planned, in order (`added_since`)
    added: list = field(init=False, default_factory=list)
    # Each stored node's candidates (log-probs, tokens: int32, a vocabulary fits at half the
    # bytes, and the constraint state each token leads to), a run of C' <= C per node in the
    # flat tables below, in any order (-inf pads).
    # Runs are as wide as their pass needs: a wide search's nodes mostly have few children, and
    # B x capacity x C tables of the widest (MBs of fresh pages a decode) cost it more than
    # its selection.
    stored_values: Tensor = field(init=False)  # [S] float32
    stored_tokens: Tensor = field(init=False)  # [S] int32
    stored_states: Tensor = field(init=False)  # [S] int64
    used: int = 0  # slots of the stored tables in use
    first: Tensor = field(init=False)  # [B, capacity] each node's first slot there
    count: Tensor = field(init=False)  # [B, capacity] its slots (0: not scored yet)
    # [B, capacity] bool: candidates known when planned (a forced token that costs nothing),
    # so the pass that carries the node (as the parent of others) need not score it
    known: Tensor = field(init=False)
    drafted: Tensor = field(init=False)  # [B, capacity] bool: planned by a drafter

    def __post_init__(self) -> None:
        on = self.device
        self.pending = torch.zeros(self.batch, dtype=torch.long, device=on)
        # At least one padding slot, so gathers at a root's parent (-1, clamped) read one.
        slots = (self.batch, max(1, self.capacity))
        self.parents = torch.full(slots, -1, dtype=torch.long, device=on)
        self.tokens = torch.zeros(slots, dtype=torch.long, device=on)
        self.states = torch.full(slots, -1, dtype=torch.long, device=on)
        self.start = (
            self.constraint.start(self.batch, on)
            if self.constraint is not None
            else torch.zeros(self.batch, dtype=torch.long, device=on)
        )
        self.keys = torch.zeros(0, dtype=torch.long, device=on)
        self.key_nodes = torch.zeros(0, dtype=torch.long, device=on)
        self.stored_values = torch.empty(self.batch * self.width, device=on)
        self.stored_tokens = torch.empty(self.batch * self.width, dtype=torch.int32, device=on)
        self.stored_states = torch.empty(self.batch * self.width, dtype=torch.long, device=on)
        self.first = torch.zeros(slots, dtype=torch.long, device=on)
        self.count = torch.zeros(slots, dtype=torch.long, device=on)
        self.known = torch.zeros(slots, dtype=torch.bool, device=on)
        self.drafted = torch.zeros(slots, dtype=torch.bool, device=on)

    def key(self, rows: Tensor, parents: Tensor, tokens: Tensor) -> Tensor:  # [Q] each -> [Q]
        """The int64 naming each (row, parent node, token): rows ascend with it."""
        # (rows * MAX_NODES + parents + 1) * V + tokens, in three ops
        vocab = self.vocab_size
        return torch.add(tokens + vocab, parents, alpha=vocab).add_(rows, alpha=MAX_NODES * vocab)

    def child(self, rows: Tensor, parents: Tensor, tokens: Tensor) -> Tensor:  # [Q] -> [Q]
        """The node each (row, parent node, token) leads to; -1 where none is scored or
        planned (a parent of -1 is the row's root position: the root node itself)."""
        keys = self.key(rows, parents, tokens)
        self._sort_keys()
        if not len(self.keys):
            return torch.full_like(keys, -1)
        at = torch.searchsorted(self.keys, keys).clamp(max=len(self.keys) - 1)
        return torch.where(self.keys[at] == keys, self.key_nodes[at], -1)

    def add(
        self, rows: Tensor, parents: Tensor, tokens: Tensor, states: Tensor | None = None
    ) -> Tensor:
        """Plan Q distinct new nodes (rows [Q] grouped ascending, their parent nodes -1 for a
        root, and tokens) for the next pass; returns their numbers [Q]. ``states``: their
        constraint states where the caller has them (a catalogue drafter reads them with the
        children), else derived from their parents'."""
        if not len(rows):
            return rows
        if states is None:
            states = self._states(rows, parents, tokens)
        nodes = self.size + self.pending[rows] + rank_within_rows(rows)  # in order, per row
        self.pending += torch.bincount(rows, minlength=self.batch)
        self._reserve(self.size + int(self.pending.max()))
        self.parents[rows, nodes], self.tokens[rows, nodes] = parents, tokens
        self.states[rows, nodes] = states
        self.unsorted.append((rows, parents, tokens, nodes))
        self.added.append((rows, nodes))
        return nodes

    def _states(self, rows: Tensor, parents: Tensor, tokens: Tensor) -> Tensor:  # [Q] each
        """The constraint state after each (parent node, token), in one batched step; a root
        (parent -1) is the row's start."""
        if self.constraint is None:
            return torch.zeros_like(rows)
        moved = self.constraint.advance(self.states[rows, parents.clamp_min(0)], tokens)
        return torch.where(parents >= 0, moved, self.start[rows])

    def _sort_keys(self) -> None:
        """Merge the keys of the nodes added since the last lookup into the sorted table."""
        if not self.unsorted:
            return
        added = zip(*self.unsorted, strict=True)
        rows, parents, tokens, nodes = (torch.cat(part) for part in added)
        keys = torch.cat([self.keys, self.key(rows, parents, tokens)])
        order = keys.argsort()
        self.keys, self.key_nodes = keys[order], torch.cat([self.key_nodes, nodes])[order]
        self.unsorted = []

    def added_since(self, mark: int) -> tuple[Tensor, Tensor]:  # -> [P] each
        """The rows and numbers of the nodes planned for the next pass by its ``add``s after
        the first ``mark`` (``len(tree.added)`` taken before them), in the order added."""
        parts = self.added[mark:]
        if len(parts) == 1:
            return parts[0]
        if not parts:
            none = torch.zeros(0, dtype=torch.long, device=self.device)
            return none, none
        rows, nodes = zip(*parts, strict=True)
        return torch.cat(rows), torch.cat(nodes)

    def count_added(self, mark: int) -> int:
        """Nodes planned for the next pass by its first ``mark`` ``add``s."""
        return sum(len(rows) for rows, _ in self.added[:mark])

    def plan(self) -> tuple[Tensor, Tensor, Tensor]:
        """Close the planned pass: every row padded to M nodes. Returns tokens, parents [B, M]
        for the target and real [B, M] bool."""
        m = int(self.pending.max())
        window = slice(self.size, self.size + m)
        real = torch.arange(m, device=self.device) < self.pending[:, None]  # [B, M]
        self.size, self.pending = self.size + m, torch.zeros_like(self.pending)
        self.added = []
        return self.tokens[:, window].contiguous(), self.parents[:, window].contiguous(), real

    def _reserve(self, needed: int) -> None:
        """Room for `needed` nodes per row, doubling (new slots are padding)."""
        have = self.parents.shape[1]
        if needed <= have:
            return
        if needed > MAX_NODES:
            raise ValueError(f"a beam search row grew past {MAX_NODES} nodes")
        extra = max(needed, 2 * have) - have

        def grown(table: Tensor, fill) -> Tensor:
            return torch.cat(
                [table, table.new_full((self.batch, extra, *table.shape[2:]), fill)], 1
            )

        self.parents, self.tokens = grown(self.parents, -1), grown(self.tokens, 0)
        self.states, self.known = grown(self.states, -1), grown(self.known, False)
        self.drafted = grown(self.drafted, False)
        self.first, self.count = grown(self.first, 0), grown(self.count, 0)

    def paths(self, rows: list[int], nodes: list[int]) -> list[list[int]]:
        """Each node's tokens from the root (excluded) down to it (included), host side."""
        parents, tokens = self.parents.tolist(), self.tokens.tolist()
        out = []
        for row, node in zip(rows, nodes, strict=True):
            path = []
            while parents[row][node] >= 0:
                path.append(tokens[row][node])
                node = parents[row][node]
            out.append(path[::-1])
        return out

    def store(
        self, rows: Tensor, nodes: Tensor, values: Tensor, tokens: Tensor, states: Tensor
    ) -> None:
        """Keep Q nodes' best candidates: rows, nodes [Q], values, tokens and the states they
        lead to [Q, C' <= C] (in any order, -inf padding a node with fewer)."""
        q, width = values.shape
        end = self.used + q * width
        # C slots to spare past the last run: `candidates` reads C' <= C slots from any run's
        # first, the last run's too
        if end + self.width > len(self.stored_values):  # doubling, as the node tables
            extra = max(end + self.width, 2 * len(self.stored_values)) - len(self.stored_values)
            self.stored_values, self.stored_tokens, self.stored_states = (
                torch.cat([table, table.new_empty(extra)])
                for table in (self.stored_values, self.stored_tokens, self.stored_states)
            )
        self.stored_values[self.used : end] = values.flatten()
        self.stored_tokens[self.used : end] = tokens.flatten()
        self.stored_states[self.used : end] = states.flatten()
        self.first[rows, nodes] = self.used + torch.arange(0, q * width, width, device=self.device)
        self.count[rows, nodes] = width
        self.used = end

    def know(self, rows: Tensor, nodes: Tensor, tokens: Tensor, states: Tensor) -> None:
        """Planned nodes [Q] whose one candidate is ``tokens`` [Q] at log-prob 0 (forced),
        leading to ``states`` [Q]."""
        zero = torch.zeros(len(rows), 1, device=self.device)
        self.store(rows, nodes, zero, tokens[:, None], states[:, None])
        self.known[rows, nodes] = True

    def candidates(self, nodes: Tensor) -> tuple[Tensor, Tensor, Tensor]:  # [B, W] -> [B, W, C']
        """The stored candidates (log-probs, tokens: int32, the states they lead to) of each
        beam's node (a node of -1 reads the root's), C' the most any of them has; -inf (token 0,
        state -1) pads, and a node not scored has none."""
        index = (
            nodes.clamp_min(0)
            + torch.arange(self.batch, device=self.device)[:, None] * self.first.shape[1]
        )
        first = self.first.view(-1)[index].flatten()  # [B * W]
        count = self.count.view(-1)[index]  # [B, W]
        width = max(1, int(count.max()))
        # Every run of `width` slots as a row of a strided view, so a run is one row's copy (a
        # node with a shorter run reads past it, into slots masked below: `store` keeps C spare)
        values = self.stored_values.unfold(0, width, 1).index_select(0, first)
        tokens = self.stored_tokens.unfold(0, width, 1).index_select(0, first)
        states = self.stored_states.unfold(0, width, 1).index_select(0, first)
        values, tokens, states = (t.view(*nodes.shape, width) for t in (values, tokens, states))
        if bool((count == width).all()):  # (the nodes of one pass have runs of one width)
            return values, tokens, states
        missing = torch.arange(width, device=self.device) >= count[..., None]  # [B, W, C']
        return (
            values.masked_fill(missing, float("-inf")),
            tokens.masked_fill(missing, 0),
            states.masked_fill(missing, -1),
        )


def rank_within_rows(rows: Tensor) -> Tensor:  # [Q] ascending -> [Q]
    """Each element's position among the elements of its row (rows grouped ascending): its
    index less that of its row's first, which one search of the sorted rows finds."""
    return torch.arange(len(rows), device=rows.device) - torch.searchsorted(rows, rows)
