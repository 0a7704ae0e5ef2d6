"""The Semantic-ID recommender as a core ``Target``: the history is the root, code levels are
tokens, so the core's ``beam_search`` (and its drafters) decode it.

    target = RecommenderTarget(model)
    catalogue = target.catalogue()
    tokens, lengths = target.prompts(values, offsets)  # the jagged histories as prompts
    out = beam_search(target, tokens, prompt_lengths=lengths, max_new_tokens=model.num_levels,
                      constraint=catalogue,
                      config=BeamConfig(num_beams=W, num_return_sequences=K, length_penalty=0))
    items = catalogue.trie.items(out.states)  # [B, K]: each result's trie leaf names it

Vocabularies: a prompt is a start token, then the history's item indices (oldest first), so an
empty history is a prompt too; generated tokens are codes in one code vocabulary of L blocks
as wide as the widest codebook, code c of level l being token ``offsets[l] + c`` (offsets[l] =
l * Vmax: a node's level is its token // Vmax, and its output block is one row of a [L, Vmax]
view). A tree's root (parent -1, the start token or the history's last item) is scored by the
history pass: its output is the level-0 log-probs; a node at depth d carries a level d - 1 code
and outputs level d's.
Outputs are the model's own log-probabilities (``outputs_log_probs``), which beam search reads
as they are, masked to the catalogue: exactly the scores of the recommender's ``beam``.

Prefill only keeps the histories: the first grow is the history pass (the model keeps its most
recent ``max_len`` items), fused with any code nodes planned below the roots; every later grow
re-scores the pending code tree against it, as ``beam`` does a level at a time. A plain search
under the catalogue skips the pending tree: it asks ``beam_candidates`` for each step's
candidates, which builds the pass's tree from the beams' levels (``beam_tree``, the native
engine's) and reads each beam's children off its level's outputs; with ``spec_beam``'s drafter
(``recsys.spec_levels``) it reads them off the prefixes scored so far instead, by each beam's
catalogue state. Any other drafter (the core's ``CatalogueDrafter``) grows the pending tree.
Items are whole code tuples, so the recommender decodes by beam search only: ``score_tree`` and
``commit`` (the single-path loop of ``generate``) are refused.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from genrec_spec.core.beam import BeamConfig, StepCandidates, beam_search
from genrec_spec.core.catalogue import TokenTrie
from genrec_spec.core.constraints import Catalogue
from genrec_spec.core.targets import grown
from genrec_spec.core.types import DecodeInputError, DraftTree
from genrec_spec.models.derived import DerivedCache
from genrec_spec.models.recsys.times import HistoryTimes
from genrec_spec.recsys.item_trie import item_trie
from genrec_spec.recsys.types import Recommendations, RecommendStats

# The model slides over long histories itself; no prompt is too long for it.
UNBOUNDED = 1 << 30
# Leave out the context prefixes of a pass that no scored node descends from when they are at
# least this share of it. The tree's attention grows with the square of its nodes, but cutting
# a small share did not pay: the demo model's batch-64 decodes at W=20 (a twentieth of the
# context cut) were slower with the cut in one measurement and no faster in a later one
# (docs/results/recsys-speed.md).
PRUNE_SHARE = 0.25


class LevelDrafter(Protocol):
    """What the step read asks of `spec_beam`'s drafter (`recsys.spec_levels.SpecLevels`, a
    core ``StepDrafter``)."""

    def history_pass(
        self, values: Tensor, offsets: Tensor, times: HistoryTimes | None
    ) -> tuple[object, int]:
        """The history pass with the early drafts: (the HistoryState, tree nodes scored)."""
        ...

    def read(self, states: Tensor, alive: Tensor) -> tuple[Tensor, int | None]:
        """The beams' next-level log-probs [B, W, >= V] by their catalogue states [B, W] (alive:
        the beams still running), and the tree nodes a follow-up pass scored (None: none)."""
        ...


@dataclass
class RecommenderCache:
    values: Tensor  # [M] int64 the B histories' items, oldest first within a row
    offsets: Tensor  # [B + 1] int64
    times: HistoryTimes | None  # their timestamps, for a time-aware model
    state: object = None  # the model's HistoryState of them, from the first grow on
    tree: DraftTree | None = None  # the nodes grown since prefill
    # Every grow's output is written here, grown as needed: a pass's output is read before the
    # next grow, and tens of MB of fresh pages a pass (wide beams, batches) cost more than
    # refilling touched ones.
    buffer: Tensor | None = None
    # A plain search's beams level by level (`beam_candidates`): each level's codes and the
    # place of the beam each extends among the level above's, [B, W] each
    codes: list[Tensor] = field(default_factory=list)
    origins: list[Tensor] = field(default_factory=list)


class RecommenderTarget:
    outputs_log_probs = True  # outputs are log-probs: read as they are, not re-normalised

    def __init__(self, model) -> None:
        self.model = model
        self.device = model.item_codes.device
        self.block = max(model.codebook_sizes)  # Vmax: a level's share of the vocabulary
        levels = torch.arange(model.num_levels + 1, device=self.device)
        self.offsets = levels * self.block  # [L + 1] each level's first token
        self.vocab_size = model.num_levels * self.block
        self.start_token = model.num_items  # every prompt's first token (module docstring)
        self.prompt_vocab_size = model.num_items + 1
        self.max_length = UNBOUNDED
        self.times = None  # the prompts' timestamps (`at_times`)

    @property
    def forced_tokens_free(self) -> bool:
        """Code levels normalised over a prefix's children give a forced code log-prob 0."""
        return self.model.forced_codes_free

    def at_times(self, times: HistoryTimes | None) -> RecommenderTarget:
        """This target reading `times` beside the histories of the prompts it is given (what a
        time-aware model needs): a copy for one decode, since the engine's prefill takes tokens
        alone (this one itself for no times: the one made per model reads none)."""
        if times is None and self.times is None:
            return self
        timed = copy.copy(self)
        timed.times = times
        return timed

    def prompts(self, values: Tensor, offsets: Tensor) -> tuple[Tensor, Tensor]:
        """Histories (jagged: values [M], offsets [B + 1]) as prompts: tokens [B, 1 + T] (the
        start token, then the history, 0-padded) and lengths [B]."""
        lengths = offsets.diff()  # [B]
        history = torch.arange(int(lengths.max()), device=values.device) < lengths[:, None]
        tokens = values.new_zeros(len(lengths), 1 + history.shape[1])  # [B, 1 + T]
        tokens[:, 0] = self.start_token
        tokens[:, 1:].masked_scatter_(history, values)  # (row-major: each row's values in order)
        return tokens, lengths + 1

    def catalogue(self) -> Catalogue:
        """The model's items as code-token sequences (fixed length L, no end token)."""
        items = item_trie(self.model)  # (built vectorised: no Python walk of 10^7 items)
        # The item trie's layout is the catalogue's (both breadth-first, children by code): edge
        # e leads to a node of depth d + 1 and carries a level-d code c, token offsets[d] + c
        per_depth = torch.tensor(items.level_starts, device=self.device).diff()[1:]  # [L]
        first_token = torch.repeat_interleave(self.offsets[:-1], per_depth)  # [edges]
        levels = self.model.num_levels
        trie = TokenTrie.from_layout(
            self.vocab_size,
            counts=items.child_offsets.diff().long(),
            tokens=items.child_codes.long() + first_token,
            leaves=torch.arange(*items.level_starts[levels:], device=self.device),
            items=items.leaf_items.long(),
            longest=levels,
            shortest=levels,
        )
        return Catalogue(trie).to(self.device)

    def prefill(
        self, tokens: Tensor, lengths: Tensor, capacity: int, hidden_layers: Sequence[int] = ()
    ) -> RecommenderCache:
        if hidden_layers:
            raise DecodeInputError(
                "the recommender exposes no hidden states to drafters",
                "use drafters that need none (the catalogue's)",
            )
        if bool((tokens[:, 0] != self.start_token).any()):
            raise DecodeInputError(
                "a recommender prompt is the target's start token, then the history",
                "make prompts with RecommenderTarget.prompts(values, offsets)",
            )
        # The history pass waits for the first grow, which also scores any code nodes planned
        # below the roots (`encode_history_and_tree`: one forward for both).
        lengths = lengths - 1  # [B] the histories'
        real = torch.arange(tokens.shape[1] - 1, device=tokens.device) < lengths[:, None]
        offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
        return RecommenderCache(tokens[:, 1:][real], offsets, self.times)

    def grow_tree(
        self, cache: RecommenderCache, tokens: Tensor, parents: Tensor, needed: Tensor | None = None
    ) -> Tensor:
        cache.tree = grown(cache.tree, tokens, parents)
        return self._score(cache, tokens.shape[1], needed)

    def beam_candidates(
        self,
        cache: RecommenderCache,
        step: int,
        last: Tensor,  # [B, W] the beams' last tokens (the root copies' at step 0)
        origin: Tensor,  # [B, W] the place of the beam each extends among the step before's
        states: Tensor,  # [B, W] their nodes in `trie`
        alive: Tensor,  # [B, W] bool the beams still running
        trie: TokenTrie,  # the search's catalogue's (``catalogue()``)
        drafter: LevelDrafter | None = None,  # spec_beam's drafts and the prefixes they scored
    ) -> StepCandidates:  # [B, W, C] each ([B, 1, C] at step 0: the root's)
        """A plain search's step, level by level as the native engine's: each beam's children in
        the catalogue, scored by one pass over the tree of the beams' levels (`score_level`: no
        tree derived from tokens and parents, no vocabulary-wide output). Step 0 is the history
        pass. A beam whose code is forced (one child) gives it log-prob 0 without the pass
        (`forced_tokens_free`); a step whose live beams are all such needs none. With
        `spec_beam`'s drafter the history pass also scores its early drafts, and a step reads
        the prefixes scored so far, with a follow-up pass where one is missing
        (`recsys.spec_levels`)."""
        if step == 0 and drafter is not None:
            cache.state, nodes = drafter.history_pass(cache.values, cache.offsets, cache.times)
            out, states = cache.state.level0_log_probs[:, None], states[:, :1]
        elif step == 0:  # the W copies of each root share its level-0 log-probs
            cache.state = self.model.encode_history(cache.values, cache.offsets, cache.times)
            out, states, nodes = cache.state.level0_log_probs[:, None], states[:, :1], 0
        elif drafter is not None:
            out, nodes = drafter.read(states, alive)
        else:
            cache.codes.append(last - (step - 1) * self.block)  # level step - 1's codes
            cache.origins.append(origin)
            scored = alive
            if self.forced_tokens_free:
                scored = alive & (trie.forced(states) < 0)
            out, nodes = score_level(self.model, cache.state, cache.codes, cache.origins, scored)
        # each beam's children in the catalogue, read off the level's outputs by their codes
        # (a slot without a child reads some edge: its value is -inf, so no beam takes it)
        edges, exists = trie.child_edges(states)  # [B, W', C] each
        tokens, after = trie.child_tokens[edges], edges + 1  # (edge e leads to node e + 1)
        codes = (tokens - step * self.block).clamp(0, out.shape[2] - 1)
        values = torch.where(exists, out.gather(2, codes), float("-inf"))
        passes = int(step == 0 or nodes is not None)
        return StepCandidates(values, tokens, after, passes, 0 if nodes is None else nodes)

    def score_tree(self, cache: RecommenderCache, tree: DraftTree) -> Tensor:
        _refuse_single_path()

    def commit(self, cache: RecommenderCache, nodes: Tensor, counts: Tensor) -> None:
        _refuse_single_path()

    def _score(
        self,
        cache: RecommenderCache,
        m: int,
        needed: Tensor | None,  # [B, M] bool the new nodes whose outputs are read (None: all)
    ) -> Tensor:  # [B, M, V] of the last m
        """Log-probs of the last m nodes of the pending tree: the roots' from the history pass,
        the code nodes' from one pass over every needed code node that predicts a level: the
        history pass itself on the first grow, then ``score_tree``. The model keeps no K/V of
        tree nodes, so earlier nodes, and new ones not needed, are context where a needed node
        descends from them. A node of the last level predicts nothing: -inf everywhere, as do
        the nodes not needed."""
        tree, model = cache.tree, self.model
        batch, n = tree.tokens.shape
        if n == 1:  # the roots alone (a plain search's first grow): the history pass
            cache.state = model.encode_history(cache.values, cache.offsets, cache.times)
            level0 = cache.state.level0_log_probs  # [B, V0]
            out = _output_buffer(cache, (batch, 1, self.vocab_size))  # [B, 1, V]
            out[:, 0, : level0.shape[1]] = level0
            return out
        # [B, N] each node's depth: a code token's value says its level (codes are offset per
        # level); roots (and padding, no beam's) are 0
        depth = torch.where(tree.parents >= 0, tree.tokens // self.block + 1, 0)
        scored = (depth > 0) & (depth < model.num_levels)
        wanted = scored.clone()
        wanted[:, : n - m] = False  # earlier nodes are context: their outputs are not needed
        unread = torch.zeros_like(wanted)
        if needed is not None:  # a new node not needed is fed only as a needed one's ancestor,
            # among the new nodes (it may descend from another needed one)
            unread[:, n - m :] = ~needed
            wanted &= ~unread
        first = cache.state is None  # the first grow encodes the histories
        any_wanted = bool(wanted.any())
        if any_wanted:
            lineage = with_ancestors(wanted, tree.parents, model.num_levels - 2)
            if needed is not None:
                scored &= ~unread | lineage
                wanted |= scored & unread  # fed and scored, but still written as -inf
            fed = context_to_score(scored, wanted, lineage)
            if bool(fed[:, 1:].all()) and bool(wanted[:, n - m :].all()):
                # every node but the roots (node 0 of each row) is fed and every new one is
                # wanted: the model's tree is the pending tree itself (new nodes last), as the
                # native engine's first levels are
                new_order = torch.arange(n - m, n, device=self.device).expand(batch, m)
                new_real = wanted[:, n - m :]
                levels = depth[:, 1:] - 1
                codes = tree.tokens[:, 1:] - self.offsets[levels]
                parents = tree.parents[:, 1:] - 1  # (a root's children: -1, below the history)
            else:
                # The model's tree: each row's context, then its new nodes, each part in tree
                # order (parents first) and padded to the row with the most, so the new nodes
                # of every row sit in the last slots, the only ones whose outputs the model
                # computes.
                context_order, context_real = in_order(fed & ~wanted)  # [B, C] each
                new_order, new_real = in_order(wanted)  # [B, W'] each
                order = torch.cat([context_order, new_order], 1)
                real = torch.cat([context_real, new_real], 1)
                codes, levels, parents = self._layout(tree, depth, fed, order, real)
            last = new_order.shape[1]
        elif first:  # the history pass alone (nothing to score below the roots)
            codes = levels = parents = tree.tokens.new_zeros(batch, 0)
            last = 0
        if first:  # the history pass, with the code nodes planned below the roots
            cache.state, log_probs = model.encode_history_and_tree(
                cache.values, cache.offsets, codes, levels, parents, cache.times
            )
            log_probs = log_probs[:, log_probs.shape[1] - last :]  # [B, W', Vmax]
            local = torch.arange(batch, device=self.device)  # [B] each row's in log_probs
        elif any_wanted:  # only the rows with a node to score take part (few miss in a batch)
            busy = wanted.any(1)  # [B]
            log_probs, local = score_rows(model, cache.state, codes, levels, parents, busy, last)
        out = _output_buffer(cache, (batch, m, self.vocab_size))  # [B, M, V]
        if first:  # the roots (a later grow's depth-0 nodes are padding, which no beam reads)
            level0 = cache.state.level0_log_probs  # [B, V0]
            rows, slots = (depth == 0)[:, n - m :].nonzero(as_tuple=True)
            out[rows, slots, : level0.shape[1]] = level0[rows]
        if not any_wanted:
            return out
        rows, slots = new_real.nonzero(as_tuple=True)  # log_probs [B, W', Vmax]: the last W'
        nodes = new_order[rows, slots]  # [Q] their tree nodes
        if needed is not None:
            read = needed[rows, nodes - (n - m)]
            rows, slots, nodes = rows[read], slots[read], nodes[read]
        following = depth[rows, nodes]  # the level each node predicts
        positions = rows * m + nodes - (n - m)  # [Q] each node's row of the outputs
        # Each node's codebook fills its level's block (log_probs are as wide as the widest
        # level scored)
        blocks = out.view(batch * m, self.model.num_levels, self.block)
        blocks[positions, following, : log_probs.shape[2]] = log_probs[local[rows], slots]
        return out

    def _layout(
        self,
        tree: DraftTree,
        depth: Tensor,  # [B, N] each node's depth (0: a root or padding)
        fed: Tensor,  # [B, N] bool the code nodes the model is fed
        order: Tensor,  # [B, S] the fed nodes, in the model's slots
        real: Tensor,  # [B, S] bool which slots hold one
    ) -> tuple[Tensor, Tensor, Tensor]:  # the model's tree: codes, levels, parents [B, S] each
        """The fed nodes as the model's tree: a node whose parent is fed points at its slot; a
        root's children (and padding) hang below the history."""
        rows, slots = real.nonzero(as_tuple=True)
        slot_of = torch.zeros_like(tree.parents)  # [B, N] a fed node's slot in `order`
        slot_of[rows, order[rows, slots]] = slots
        parent = tree.parents.gather(1, order).clamp_min(0)  # a root's children: below history
        parents = torch.where(real & fed.gather(1, parent), slot_of.gather(1, parent), -1)
        levels = torch.where(real, depth.gather(1, order) - 1, 0)
        codes = torch.where(real, tree.tokens.gather(1, order) - self.offsets[levels], 0)
        return codes, levels, parents


def _output_buffer(cache: RecommenderCache, shape: tuple[int, ...]) -> Tensor:
    """The cache's output buffer as a tensor of `shape`, all -inf (valid until the next grow)."""
    size = math.prod(shape)
    if cache.buffer is None or len(cache.buffer) < size:
        cache.buffer = torch.empty(size, device=cache.values.device)
    return cache.buffer[:size].view(shape).fill_(float("-inf"))


def score_rows(
    model,  # SemanticIdRecommender
    state,  # HistoryState of B users
    codes: Tensor,  # [B, S] the model's tree (`score_tree`'s arguments)
    levels: Tensor,  # [B, S]
    parents: Tensor,  # [B, S]
    busy: Tensor,  # [B] bool the rows with a node to score
    last: int,  # the last slots whose outputs are wanted
) -> tuple[Tensor, Tensor]:  # log-probs [b, last, Vmax], [B] each busy row's row in them
    """`score_tree` of the busy rows alone (both engines' passes)."""
    if not bool(busy.all()):
        state = state.rows(busy.nonzero().squeeze(1))
        codes, levels, parents = codes[busy], levels[busy], parents[busy]
    return model.score_tree(state, codes, levels, parents, last=last), busy.long().cumsum(0) - 1


def score_level(
    model,  # SemanticIdRecommender
    state,  # HistoryState of B users
    codes: list[Tensor],  # [B, W_d] each level's beams' codes (`beam_tree`)
    origins: list[Tensor],  # [B, W_d] each beam's place among the level above's
    scored: Tensor,  # [B, W] bool the current beams whose next code the pass scores
) -> tuple[Tensor, Tensor | None]:  # [B, W, >= V] log-probs, tree nodes scored (None: no pass)
    """The next level's log-probs of a level-by-level search's current beams (both engines'):
    one pass over the tree of their levels for the `scored` beams, in the rows that have one.
    A beam not scored reads 0: a forced code's log-prob, or a dead beam's, which the caller
    drops. No beam scored: no pass."""
    busy = scored.any(1)  # [B] the rows with a beam to score
    every = bool(scored.all())
    if not every:
        out = torch.zeros(*scored.shape, max(model.codebook_sizes), device=scored.device)
        if not bool(busy.any()):
            return out, None
    tree_codes, levels, parents, picked, real = beam_tree(codes, origins, scored)
    # [b, W', Vmax]: only the scored beams' log-probs; earlier prefixes are context
    got, local = score_rows(model, state, tree_codes, levels, parents, busy, picked.shape[1])
    if every:  # every beam, in order: the output as it is
        out = got
    else:
        rows, slots = real.nonzero(as_tuple=True)
        out[rows, picked[rows, slots], : got.shape[2]] = got[local[rows], slots]
    return out, busy.sum() * tree_codes.shape[1]


def beam_tree(
    codes: list[Tensor],  # [B, W_d] each level's beams' codes, levels 0..l-1
    origins: list[Tensor],  # [B, W_d] each beam's place among the level above's (level 0: any)
    scored: Tensor,  # [B, W_l-1] bool the last level's beams whose next level is scored
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The prefixes of all beams of lengths 1..l as one tree per row (both engines' model tree
    of a level-by-level search): node sum(W_0..W_d-1) + w is beam w of length d + 1, its parent
    the beam it extends. Returns codes, levels, parents [B, N], the last W' nodes the `scored`
    current beams, and which current beam each of those is and whether it is real ([B, W']
    each).

    The earlier levels are context: the model keeps no K/V of tree nodes, so every pass scores
    them again. A node attends to the history and its own ancestors alone, so a prefix that no
    scored beam extends changes no score; where such prefixes are a large enough share of the
    context (wide beams, whose lower levels converge on fewer prefixes), they are left out, as
    the tree's attention grows with the square of its nodes (`context_to_score`). The kept
    context then fills the first slots of each row in order, and the scored beams the last, rows
    with fewer padding with unattached nodes (level 0, parent -1)."""
    starts = [0]
    for level in codes[:-1]:
        starts.append(starts[-1] + level.shape[1])
    levels = torch.cat([torch.full_like(c, d) for d, c in enumerate(codes)], 1)
    parents = torch.cat(
        [o + starts[d - 1] if d else torch.full_like(o, -1) for d, o in enumerate(origins)], 1
    )
    codes = torch.cat(codes, 1)  # [B, N]
    batch, n = codes.shape
    context = starts[-1]
    wanted = torch.cat([torch.zeros_like(codes[:, :context], dtype=torch.bool), scored], 1)
    feedable = torch.cat([torch.ones_like(wanted[:, :context]), scored], 1)
    lineage = with_ancestors(wanted, parents, len(starts) - 1)
    needed = context_to_score(feedable, wanted, lineage)[:, :context]
    if bool(needed.all()) and bool(scored.all()):
        every = torch.arange(n - context, device=codes.device).expand(batch, -1)
        return codes, levels, parents, every, scored
    order, kept = in_order(needed)  # [B, C] each: the context nodes a row keeps, in order
    picked, chosen = in_order(scored)  # [B, W'] each: the scored beams, in order
    index = torch.cat([order, picked + context], 1)  # [B, C + W']
    real = torch.cat([kept, chosen], 1)
    slot_of = torch.cumsum(needed.long(), 1) - 1  # [B, context] a kept node's new slot
    above = parents.gather(1, index)  # the parents' old slots (all context nodes)
    # The level-0 beams have no context (nor parents) to look up.
    moved = slot_of.gather(1, above.clamp(min=0)) if context else above
    return (
        torch.where(real, codes.gather(1, index), 0),
        torch.where(real, levels.gather(1, index), 0),
        torch.where(real & (above >= 0), moved, -1),
        picked,
        chosen,
    )


def in_order(mask: Tensor) -> tuple[Tensor, Tensor]:  # [B, N] -> [B, S] each
    """Each row's marked nodes in tree order, padded to the row with the most: their node
    numbers, and which are real."""
    order = torch.sort((~mask).long(), dim=1, stable=True).indices[:, : int(mask.sum(1).max())]
    return order, mask.gather(1, order)


def context_to_score(
    scored: Tensor,  # [B, N] bool the nodes a pass may feed the model
    wanted: Tensor,  # [B, N] bool those of them whose outputs it needs
    lineage: Tensor,  # [B, N] bool the wanted nodes and their ancestors (`with_ancestors`)
) -> Tensor:  # [B, N] bool: `scored`, or its wanted nodes and their ancestors
    """What a recommender pass feeds the model (both engines' rule). A node attends to the
    history and its own ancestors alone, so context the wanted nodes do not descend from changes
    no score; it is left out where it is at least `PRUNE_SHARE` of the context of the row that
    keeps the most."""
    kept = scored & lineage
    context = int((scored & ~wanted).sum(1).max())
    return kept if int((kept & ~wanted).sum(1).max()) <= (1 - PRUNE_SHARE) * context else scored


def with_ancestors(marked: Tensor, parents: Tensor, depth: int) -> Tensor:  # [B, N] each
    """The marked nodes and their ancestors up to `depth` levels above them."""
    marked, up, attached, above = marked.clone(), marked, parents >= 0, parents.clamp_min(0)
    for _ in range(depth):  # a level at a time: each marked node's parent, counted
        counts = torch.zeros_like(marked, dtype=torch.int32)
        up = counts.scatter_add_(1, above, (up & attached).int()) > 0
        marked |= up
    return marked


_TARGETS = DerivedCache()  # model -> its target, again when its item codes change
_CATALOGUES = DerivedCache()  # item_codes table -> the catalogue of its items


def core_target(model) -> tuple[RecommenderTarget, Catalogue]:
    """The model as a core target, made once per model, and its catalogue, made once per item
    table (a model seen through a wrapper, a history cache's, shares it): both again when the
    item codes change."""
    codes = model.item_codes
    target = _TARGETS.get(model, (codes,), lambda: RecommenderTarget(model))
    return target, _CATALOGUES.get(codes, (codes,), target.catalogue)


def core_beam(
    model,  # SemanticIdRecommender
    values: Tensor,  # [M] int64 history item indices, oldest first within a row
    offsets: Tensor,  # [B + 1] int64
    k: int,
    width: int,  # W
    start_time: float,  # perf_counter() when the decode began (the stats' wall time)
    drafter: LevelDrafter | None = None,  # spec_beam's drafts (`recsys.spec_levels`)
    times: HistoryTimes | None = None,  # the histories' timestamps (a time-aware model)
) -> Recommendations:
    """The recommender's trie-constrained beam search on the core (module docstring): items and
    scores as the recommender's ``beam`` gives them, with its stats."""
    target, catalogue = core_target(model)
    target = target.at_times(times)
    tokens, lengths = target.prompts(values, offsets)  # [B, 1 + T], [B]
    out = beam_search(
        target,
        tokens,
        prompt_lengths=lengths,
        config=BeamConfig(num_beams=width, num_return_sequences=k, length_penalty=0.0),
        max_new_tokens=model.num_levels,
        constraint=catalogue,
        drafter=drafter,
    )
    return Recommendations(
        items=catalogue.trie.items(out.states),
        scores=out.scores,
        stats=RecommendStats(
            target_passes=out.stats.target_forwards,
            nodes_scored=out.stats.nodes_scored,
            wall_time_s=time.perf_counter() - start_time,
            truncated_histories=int((lengths - 1 > model.config.max_len).sum()),
            draft_nodes=None if drafter is None else out.stats.draft_nodes,
            draft_hit_rate=(
                None if drafter is None else out.stats.draft_hits / max(out.stats.needed_nodes, 1)
            ),
        ),
    )


def _refuse_single_path() -> None:
    """``generate``'s score-then-commit loop keeps one path; a recommendation is K whole items."""
    raise DecodeInputError(
        "the recommender emits whole items (code tuples): it decodes by beam search",
        "use genrec_spec.beam_search with the target's catalogue",
    )
