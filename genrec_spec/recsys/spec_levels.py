"""`spec_beam`'s scoring, level by level, for both engines: the drafted prefixes scored with the
history, and a follow-up pass where a level's beams reach a prefix not scored yet.

    levels = SpecLevels(model, trie, draft="items", ...)
    state, nodes = levels.history_pass(values, offsets, times)  # pass 1: histories and drafts
    out, nodes = levels.log_probs(beams.nodes)  # [B, W, >= V] each beam's next-level log-probs

The native decoder (`decoders.spec_beam`) selects with `beam.extend`; the core's `beam_search`
hands this object to the target's own step read (`RecommenderTarget.beam_candidates`), which
asks it with the beams' catalogue states (`read`) and leaves the selection to the core. Both
therefore score the same prefixes in the same passes (`decoders.spec_beam` explains the drafts
and the follow-ups).

Shape letters: B users, W beams, N tree nodes, V codes, L code levels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from genrec_spec.data_pipelines.jagged import spell_out_ranges
from genrec_spec.data_pipelines.trie import PrefixTrie
from genrec_spec.models.recsys.times import HistoryTimes
from genrec_spec.recsys.drafters import AFTER_HISTORY, after_history_draft, draft_member
from genrec_spec.recsys.scoring import NodeSet, PrefixTree, TrieIndex, prefix_tree


@dataclass(frozen=True)
class ScoredNodes:
    """The target's log-probs at every prefix scored so far, per row."""

    members: NodeSet  # the (row, trie node) pairs scored
    slots: Tensor  # [K] each member's index into log_probs' node axis
    log_probs: Tensor  # [B, N, Vmax] next-level log-probs of the scored nodes

    @classmethod
    def of(cls, tree: PrefixTree, log_probs: Tensor) -> ScoredNodes:  # tree of every row
        return cls(tree.members, tree.slots, log_probs)

    def add(
        self,
        rows: Tensor,  # [b] int64 the rows the tree is of, ascending
        tree: PrefixTree,  # of those b rows
        log_probs: Tensor,  # [b, N', Vmax] its log-probs
    ) -> ScoredNodes:
        """Nodes already scored keep their first value (a rescored ancestor is only context)."""
        batch, known, vocab = self.log_probs.shape
        new = self.members.stride * rows[tree.members.rows] + tree.members.nodes  # [K'] keys
        fresh = ~self.members.position(new)[1]
        keys = torch.cat([self.members.keys, new[fresh]])
        order = keys.argsort()
        slots = torch.cat([self.slots, tree.slots[fresh] + known])[order]
        grown = log_probs
        if len(rows) < batch:  # the other rows' slots: never read
            grown = log_probs.new_zeros(batch, log_probs.shape[1], vocab)
            grown[rows] = log_probs
        return ScoredNodes(
            NodeSet(keys[order], self.members.stride),
            slots,
            torch.cat([self.log_probs, grown], dim=1),
        )

    def lookup(self, nodes: Tensor) -> Tensor:  # nodes: [B, W] -> [B, W] slot, -1 = unscored
        return self.members.value_at(self.slots, nodes)


class SpecLevels:
    """One decode's drafts and scored prefixes (module docstring): one decode at a time."""

    # The core's beam search hands a drafter with this mark to the target's own step read
    # (`core.beam`), which asks it in the recommender's terms.
    step_read = True

    def __init__(
        self,
        model,  # SemanticIdRecommender
        trie: PrefixTrie,  # the model's items
        draft: str,  # "items", "heads", "nezha", "frontier" or "none" (`spec_beam`)
        draft_width: int,  # "items", "heads": prefixes per length; "nezha": its beam's width
        item_search: str,  # "items": "exact", "index" or "auto"
        lookahead: int,  # descendant levels of the beams a follow-up pass also scores
        draft_codes: Tensor | None = None,  # [B, R, L] codes of items whose prefixes are drafted
    ) -> None:
        self.model, self.trie = model, trie
        self.draft, self.draft_width, self.item_search = draft, draft_width, item_search
        self.lookahead, self.draft_codes = lookahead, draft_codes
        self.index = TrieIndex.of(trie)
        # [scorable + 1] the prefixes whose next code is not free, and False for no prefix (node
        # -1 reads the last entry)
        to_score = self.index.to_score(model)
        self.to_score = torch.cat([to_score, to_score.new_zeros(1)])

    def history_pass(
        self, values: Tensor, offsets: Tensor, times: HistoryTimes | None
    ) -> tuple[object, int]:  # HistoryState of the B histories, tree nodes scored
        """Pass 1: the histories, fused with what can be drafted before them (the frontier,
        the prefixes of given items)."""
        batch = offsets.numel() - 1
        member = draft_member(self.trie, self.index, batch, self.draft, self.draft_codes)
        first = prefix_tree(self.index, self.index.scored(member, self.to_score), batch)
        self.state, log_probs = self.model.encode_history_and_tree(
            values, offsets, first.codes, first.levels, first.parents, times
        )
        self.scored = ScoredNodes.of(first, log_probs)
        self.drafted = first.members  # prefixes some draft proposed (and worth scoring)
        self.drafted_after = self.draft not in AFTER_HISTORY
        if self.drafted_after:  # (else with the draft made from the histories)
            self.drafted = self.index.scored(self.drafted, self.to_score)
        self.needed: list[Tensor] = []  # [B, W] per level: the prefixes that needed a score
        return self.state, first.real_nodes

    def read(self, states: Tensor, alive: Tensor) -> tuple[Tensor, int | None]:
        """`log_probs` of the core's beams: their catalogue states [B, W] (alive [B, W] bool,
        the beams still running), which are the beams' prefixes: the catalogue's trie and the
        model's item trie number their nodes alike (breadth-first, children by code)."""
        return self.log_probs(states.masked_fill(~alive, -1))

    def log_probs(self, nodes: Tensor) -> tuple[Tensor, int | None]:
        """Each beam's next-level log-probs (nodes [B, W]: the beams' prefixes, -1 none), after a
        follow-up pass where a beam's prefix needs a score and has none; tree nodes scored
        (None: no pass). A beam whose next code is free reads 0, as does one without a prefix
        (the caller drops it)."""
        if not self.drafted_after:  # at the level-0 beams: the draft made from the histories
            self.drafted_after = True
            drafted = self.drafted | after_history_draft(
                self.model, self.state, nodes, self.trie, self.draft, self.draft_width,
                self.item_search,
            )  # fmt: skip
            self.drafted = self.index.scored(drafted, self.to_score)
        scored, state = self.scored, self.state
        slot = scored.lookup(nodes)  # [B, W]
        need = self.to_score[nodes]  # [B, W] a code to score
        self.needed.append(nodes.masked_fill(~need, -1))
        missing = need & (slot < 0)
        tree_nodes = None
        if bool(missing.any()):  # a follow-up pass only when some row needs one
            want = self._follow_up(nodes, missing)
            # Only the rows with something to score take part (in a batch, few rows miss).
            busy = torch.unique(want.rows)  # [b] ascending
            if len(busy) < len(nodes):  # the tree of the busy rows alone, numbered 0..b-1
                state = state.rows(busy)
                want = self.index.node_set(torch.searchsorted(busy, want.rows), want.nodes)
            tree = prefix_tree(self.index, want, len(busy))
            out = self.model.score_tree(state, tree.codes, tree.levels, tree.parents)
            self.scored = scored = scored.add(busy, tree, out)
            tree_nodes = tree.real_nodes
            slot = scored.lookup(nodes)
        if not scored.log_probs.shape[1]:  # nothing scored yet, so no beam needs a score
            return scored.log_probs.new_zeros(*nodes.shape, 1), tree_nodes
        rows = torch.arange(len(nodes), device=nodes.device)[:, None]
        out = scored.log_probs[rows, slot.clamp(min=0)].masked_fill(~need[..., None], 0.0)
        return out, tree_nodes

    def counts(self) -> tuple[int, Tensor, Tensor]:
        """Prefixes drafted; the beams' distinct prefixes that needed a score over the decode
        (on the core, beams from the root's copies share theirs), and those of them some draft
        proposed (the draft's hits)."""
        # (a decode reads at least level 1: L >= 2)
        needed = self.index.rowwise(torch.cat(self.needed, dim=1))
        hits = self.drafted.position(needed.keys)[1].sum()
        return len(self.drafted), hits.new_tensor(len(needed)), hits

    def _follow_up(self, nodes: Tensor, missing: Tensor) -> NodeSet:
        """The prefixes a follow-up pass scores: the missing ones, the drafted ones not yet
        scored, and the unscored descendants of every beam `lookahead` levels down."""
        index, scored = self.index, self.scored.members
        want = index.rowwise(nodes.masked_fill(~missing, -1)) | (self.drafted - scored)
        below = index.rowwise(nodes) if self.lookahead else None
        for _ in range(self.lookahead):  # descendants of the beams the next levels can need
            below = children_of(self.trie, below)
            want = want | index.scored(below - scored, self.to_score)
        return want


def children_of(trie: PrefixTrie, member: NodeSet) -> NodeSet:
    """Every child of a member (below `member.stride`, the scorable levels). Node n's children
    are the consecutive ids child_offsets[n] + 1 .. child_offsets[n+1] (edge e leads to node
    e + 1): each member's range is spelled out, so the work follows the members' children."""
    rows, nodes = member.rows, member.nodes  # [M] each
    first = trie.child_offsets[nodes].long() + 1  # [M] each member's first child
    counts = trie.child_offsets[nodes + 1].long() + 1 - first  # [M]
    # [sum counts]: first[m], first[m] + 1, ..., first[m] + counts[m] - 1 for each member m
    owner, child = spell_out_ranges(first, counts)
    inside = child < member.stride  # children past the scorable levels are left out
    return NodeSet.of(rows[owner][inside], child[inside], member.stride)
