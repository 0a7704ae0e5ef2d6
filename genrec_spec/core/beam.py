"""Beam search for every target, plain or speculative, with or without a constraint.

    beam_search(target, input_ids, *, config=BeamConfig(num_beams=W, num_return_sequences=K),
                max_new_tokens, eos_token_id, constraint=None, drafter=None,
                record=None) -> BeamOutput

The W beams of a row are branches of one tree over the row's prompt, whose K/V are stored once:
a pass grows the tree by the nodes the beams need (``Target.grow_tree``). A *step* selects the
beams one token longer; a *pass* is one target forward. Plain beam search scores each step's
new nodes in fixed slots, beam w's the step's w-th, and reads their candidates straight from
the pass; speculative beam search keeps every scored node's best next-token log-probabilities
(``BeamTree``), so they serve every later step that reaches the node.

Selection is transformers' beam search, step for step: each step keeps the top 2W candidates (W
beams x their tokens, scored by summed log-probabilities), the best W that did not just end run
on, and those of the top W that ended (an eos token, or max_new_tokens) enter the W finished
hypotheses with score / length ** length_penalty; early stopping and the "can a running beam
still win" heuristic follow ``early_stopping`` as there. Without end tokens every hypothesis
ends at max_new_tokens, so each step keeps the best W and the last step's best W finish at once
(the same result; which of tied candidates come first aside). The first step starts from W
copies of the root, all but one scored -1e9; a target that scores its prefill
(``scores_prefill``) gives the root's log-probs with the prompt's K/V, as transformers' prefill
does, so the first step needs no pass of its own (the prefill counts as its pass). So the
outputs equal ``generate(num_beams=W, num_return_sequences=K, length_penalty=...,
early_stopping=...)`` (with ``prefix_allowed_tokens_fn`` for a constraint) up to float ties. A
finished row stops asking for passes; it rides along until every row is done. Where fewer than K
real hypotheses finish (a catalogue narrower than the beam, with early stopping) the rest are
continuations of the root's copies, scored about -1e9 / length ** length_penalty as
transformers' are; which copies those are is a float tie (float32 steps by 64 at 1e9, so their
log-probs do not count). A step's 2W are kept with equal scores in place order (beam, then the
node's candidate order: a catalogue's children in token order), as a stable sort keeps them and
the recommender's native ``beam`` does: the W x C table they come from is as wide as the step's
widest node, which differs between plain and speculative search, and ``topk`` orders ties by
where it meets them. The running W and the finished W are then picked from tables as wide as
transformers' (2W and W + 2W) by ``topk``, as there. So plain and speculative search keep the
same copies; from transformers' W x V table the 2W may be other copies, and with
``early_stopping=True``, where they count toward a row's W finished hypotheses, such a row may
stop at another step than transformers' and return other real results. One more difference from
transformers' ``prefix_allowed_tokens_fn`` (which must allow some token after an item's end,
typically eos again): a catalogue allows nothing there. Where fewer than W candidates did not
end, an ended one runs on at -1e9 as there, and dies here where transformers' ends again as a
hypothesis that counts toward ``early_stopping=True``'s W: such a row may stop later than
transformers' and return better hypotheses.

Speculative beam search: a ``drafter`` adds nodes below the beams to every pass (the
catalogue's forced continuations: ``core.catalogue_drafter.CatalogueDrafter``; what followed
each beam's last tokens earlier in its text: ``core.prompt_lookup.PromptLookupDrafter``); a
step whose beams all reach scored nodes needs no pass. Given a ``record``
(``core.draft_record.DraftRecord``, kept by the caller across its searches), a search drafts
only while drafting earned more than it cost in the searches before it. Selection reads the
same log-probabilities, so the output is plain beam search's, up to the float rounding of a
node scored in another pass.

A target may read a plain search's step itself under a catalogue: ``beam_candidates(cache, step,
last, origin, states, alive, trie, drafter) -> StepCandidates``, the beams' candidates from the
beams as they are (the recommender builds its pass's tree from the beams' levels and reads each
beam's children off its level's outputs), where other targets grow the pending tree. Such a
search may still draft: a drafter made for the target's step read (``StepDrafter``: the
recommender's ``recsys.spec_levels``, which keeps the prefixes it has scored by catalogue state)
is handed to it each step, and the selection, the stopping and the stats stay the core's.

Plain or speculative, a catalogue's forced token costs exactly 0 where log-probs are renormalised
over the allowed tokens (``BeamConfig.renormalize``, or a target whose outputs are:
``forced_tokens_free``): its node's candidates are known without the target, so a step whose new
nodes are all such needs no pass; they wait, planned, for the pass that scores their children.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

import torch
from torch import Tensor

from genrec_spec.core.beam_tree import MAX_NODES, BeamTree
from genrec_spec.core.constraints import (
    Catalogue,
    Constraint,
    catalogue_log_probs,
    check_catalogue,
    log_probs,
)
from genrec_spec.core.decode import (
    _check_limits,
    check_end_tokens,
    pack_prompts,
    prefill_checked,
)
from genrec_spec.core.draft_record import DraftRecord
from genrec_spec.core.targets import Target, as_target
from genrec_spec.core.types import DecodeInputError, DecodeStats, Generation

UNREACHABLE = -1.0e9  # transformers' score for beams and hypotheses that must not win
# Scores a step's table holds at most for `stable_top` to sort it whole: on a CPU, one thread, a
# stable sort of up to about 2,000 scores cost less than `topk` and its tie test (a few calls
# of a few microseconds each), and far more above (its algorithm changes).
SORT_SCORES = 2048


@dataclass(frozen=True)
class BeamConfig:
    """Beam search settings (transformers' names and defaults where it has them)."""

    num_beams: int = 4  # W
    num_return_sequences: int = 1  # K <= W results per row
    length_penalty: float = 1.0  # a finished beam scores sum(log-probs) / length ** this
    early_stopping: bool | str = False  # True, False (a heuristic) or "never", as transformers
    # Constrained log-probs: False masks the full vocabulary's (transformers' rule); True
    # renormalises them over the allowed tokens (the recommender's: a forced token costs 0).
    renormalize: bool = False
    # Nodes a drafter may add to one pass, shared by the rows: a pass costs more with every
    # node, and in a batch each row's share of a saved pass's fixed cost is smaller.
    draft_nodes: int = 32


@dataclass(frozen=True)
class BeamOutput(Generation):
    """K results per row, best first, as a ``Generation`` of B * K ragged rows: row b's k-th
    sequence (generated tokens, eos included) is ragged row b * K + k."""

    scores: Tensor  # [B, K] float32, the length-penalised scores
    # [B, K] each result's constraint state at its end: under a catalogue its trie leaf, whose
    # item is ``constraint.trie.items(states)``
    states: Tensor

    def tolist(self) -> list[list[list[int]]]:  # [B][K] token lists
        flat, k = super().tolist(), self.scores.shape[1]
        return [flat[b * k : (b + 1) * k] for b in range(len(flat) // k)]


@dataclass(frozen=True)
class StepCandidates:
    """A plain search step's candidates from a target that reads them itself under a catalogue
    (``beam_candidates``: the recommender, level by level), [B, W, C] each."""

    values: Tensor  # log-probs (-inf pads)
    tokens: Tensor  # their tokens
    states: Tensor  # the catalogue nodes they lead to
    passes: int  # target passes the step took (0 or 1)
    nodes: Tensor | int  # tree nodes the pass scored (a () int64 tensor, or 0)


class StepDrafter(Protocol):
    """A drafter made for a target's own step read (``beam_candidates``, the recommender's:
    ``recsys.spec_levels``): the search hands it to the target at every step, which asks it in
    its own terms, and reads its counts at the end."""

    step_read: bool  # True: this kind

    def counts(self) -> tuple[int, Tensor, Tensor]:
        """Nodes drafted; the live beams' nodes whose scores the target computed, over the
        search, and those of them drafted."""
        ...


class BeamDrafter(Protocol):
    def begin(self, tokens: Tensor, lengths: Tensor) -> None:
        """A search starts: its prompts (tokens [B, T], right-padded, lengths [B])."""
        ...

    def draft(self, tree: BeamTree, rows: Tensor, nodes: Tensor, budget: int, cache) -> None:
        """Plan at most ``budget`` nodes per row with ``tree.add`` below the frontier, none
        deeper than ``tree.max_depth`` (the tree derives each node's constraint state,
        ``tree.states``): rows,
        nodes [F] the live beams' nodes, once each, rows grouped ascending and each row's best
        beam first; ``cache`` is the target's (``Target.prefill``'s), for drafts that read
        the target's own state of the prompts (a recommender's encoded histories)."""
        ...


@dataclass
class _Beams:
    """The running beams and finished hypotheses of B rows (transformers' beam state)."""

    scores: Tensor  # [B, W] running scores (summed log-probs)
    sequences: Tensor  # [B, W, T] running beams' generated tokens
    nodes: Tensor  # [B, W] tree node of each beam's last token; -1: not scored yet
    parents: Tensor  # [B, W] tree node of the token before it (-1: the root itself)
    last: Tensor  # [B, W] each beam's last token
    states: Tensor  # [B, W] each beam's constraint state after it (a catalogue's: trie node)
    origin: Tensor  # [B, W] the beam it extends (its place among the beams a step before)
    done_scores: Tensor  # [B, W] finished hypotheses' penalised scores
    done_sequences: Tensor  # [B, W, T]
    done_lengths: Tensor  # [B, W]
    done_states: Tensor  # [B, W]
    done: Tensor  # [B, W] bool, slot holds a finished hypothesis
    improvable: Tensor  # [B, 1] bool, a running beam may still beat the finished ones


def beam_search(
    target: object,
    input_ids: Tensor | Sequence[Sequence[int]],
    *,
    config: BeamConfig | None = None,
    max_new_tokens: int = 32,
    eos_token_id: int | Sequence[int] | None = None,
    constraint: Constraint | None = None,
    drafter: BeamDrafter | None = None,
    prompt_lengths: Tensor | None = None,
    record: DraftRecord | None = None,
) -> BeamOutput:
    """Beam search (module docstring). target and input_ids as ``generate`` takes them."""
    config = config or BeamConfig()
    target = as_target(target)
    tokens, lengths = pack_prompts(input_ids, prompt_lengths)
    # The search's tables live where the target's outputs do (on a GPU, beside them: no copy
    # of a pass's logits to the host)
    device = getattr(target, "device", tokens.device)
    tokens, lengths = tokens.to(device), lengths.to(device)
    if isinstance(constraint, Catalogue):
        constraint = constraint.to(device)
    _check_limits(target, lengths, max_new_tokens)
    eos = (
        []
        if eos_token_id is None
        else torch.as_tensor(eos_token_id, device="cpu").flatten().tolist()
    )
    _check_config(config, constraint, eos, max_new_tokens, getattr(target, "vocab_size", None))
    started = time.perf_counter()
    with torch.inference_mode():
        # A target that scores its prefill gives the roots' log-probs with it: the first step
        # needs no pass of its own
        scored = getattr(target, "scores_prefill", False)
        capacity = tokens.shape[1] + max_new_tokens
        cache, roots = prefill_checked(target, tokens, lengths, capacity, scored=scored)
        # transformers keeps 2W candidates a step (more with several eos tokens), so a node
        # needs no more than its best 2W next tokens, nor more than a catalogue allows; without
        # end tokens a step keeps its best W (`_select`), and so a node its best W.
        keep = max(2, 1 + len(eos)) * config.num_beams if eos else config.num_beams
        allows = constraint.trie.widest if isinstance(constraint, Catalogue) else keep
        width = min(keep, target.vocab_size, allows)
        if drafter is not None and record is not None and not record.drafts():
            drafter = None  # drafting did not pay in the record's searches: a plain search
        args = (target, cache, roots, tokens, lengths, config, constraint, width)
        if drafter is None or getattr(drafter, "step_read", False):
            search: _PlainSearch | _TreeSearch = _PlainSearch(*args, drafter=drafter)
        else:
            search = _TreeSearch(*args, drafter, max_new_tokens)
            drafter.begin(tokens, lengths)
        start = constraint.start(len(tokens), device) if constraint is not None else None
        beams = _start(tokens, lengths, config.num_beams, max_new_tokens, start)
        eos_t = torch.tensor(eos, dtype=torch.long, device=device)
        # Without end tokens no row stops before the last step (`_select`): every row, always
        every_row = None if eos else torch.ones(len(tokens), dtype=torch.bool, device=device)
        for step in range(max_new_tokens):
            open_rows, alive = _running(beams, config, every_row)  # [B], [B, W]
            # [B, W, C] each: the beams' best next tokens, their log-probs and states ([B, 1, C]
            # at the first step, where the W beams are copies of the root: its candidates once)
            values, options, after = search.candidates(beams, open_rows, alive, step)
            if every_row is None:  # (else the beams not alive are those scored -inf: so are
                # their candidates, summed with it)
                values = values.masked_fill(~alive[:, : values.shape[1], None], float("-inf"))
            search.nan |= values.isnan().any()  # a NaN logit makes its node's log-probs NaN
            ended = _select(
                beams, values, options, after, eos_t, keep, step, max_new_tokens, config
            )
            search.row_steps += open_rows.sum()
            last = step + 1 == max_new_tokens  # (the loop ends: no stopping rule to apply)
            if not last and not _unfinished(beams, ended, step + 1, max_new_tokens, config):
                break
    search.check_finite()
    if drafter is not None and record is not None:
        record.count(search.drafted_passes, search.saved)
    return _output(beams, config.num_return_sequences, search, time.perf_counter() - started)


def _check_config(
    config: BeamConfig,
    constraint: Constraint | None,
    eos: list[int],
    max_new_tokens: int,
    vocab_size: int | None,  # the target's
) -> None:
    k = config.num_return_sequences
    check_beam_counts(config.num_beams, k)
    if not math.isfinite(config.length_penalty):  # (NaN scores every hypothesis alike)
        raise DecodeInputError(
            f"length_penalty = {config.length_penalty}",
            "pass a finite length penalty (1.0, transformers' default; 0 ranks by summed "
            "log-probs)",
        )
    if config.early_stopping not in (True, False, "never"):
        raise DecodeInputError(
            f"early_stopping = {config.early_stopping!r}", 'pass True, False or "never"'
        )
    check_end_tokens(eos, vocab_size)
    check_catalogue(constraint, eos, max_new_tokens, vocab_size)
    if isinstance(constraint, Catalogue) and k > constraint.trie.num_items:
        raise DecodeInputError(
            f"num_return_sequences = {k} is larger than the catalogue "
            f"({constraint.trie.num_items} items)",
            f"ask for at most {constraint.trie.num_items} results",
        )


def check_beam_counts(num_beams: int, num_return_sequences: int) -> None:
    """W >= 1 beams and 1 <= K <= W results, or a DecodeInputError saying which."""
    w, k = num_beams, num_return_sequences
    if w < 1 or k < 1:
        raise DecodeInputError(
            f"num_beams = {w} and num_return_sequences = {k} must both be >= 1",
            "ask for at least one beam and one result",
        )
    if k > w:
        raise DecodeInputError(
            f"num_return_sequences = {k} is larger than num_beams = {w}",
            f"pass num_beams >= {k} (--num-beams on the command line): beam search returns "
            "at most its W beams (--num-return-sequences)",
        )


def _start(
    tokens: Tensor, lengths: Tensor, w: int, max_new_tokens: int, start: Tensor | None
) -> _Beams:
    """W copies of each row's root, all but the first unreachable (as transformers starts);
    start [B]: the rows' constraint states (None: no constraint, all 0)."""
    batch, on = tokens.shape[0], tokens.device
    if start is None:
        start = torch.zeros(batch, dtype=torch.long, device=on)
    scores = torch.zeros(batch, w, device=on)
    scores[:, 1:] = UNREACHABLE
    root = tokens.gather(1, (lengths - 1)[:, None]).expand(batch, w)
    empty = torch.zeros(batch, w, max_new_tokens, dtype=torch.long, device=on)
    return _Beams(
        scores=scores,
        sequences=empty,
        nodes=torch.full((batch, w), -1, dtype=torch.long, device=on),
        parents=torch.full((batch, w), -1, dtype=torch.long, device=on),
        last=root.clone(),
        states=start[:, None].expand(batch, w),
        origin=torch.zeros(batch, w, dtype=torch.long, device=on),
        done_scores=torch.full((batch, w), UNREACHABLE, device=on),
        done_sequences=empty.clone(),
        done_lengths=torch.zeros(batch, w, dtype=torch.long, device=on),
        done_states=torch.full((batch, w), -1, dtype=torch.long, device=on),
        done=torch.zeros(batch, w, dtype=torch.bool, device=on),
        improvable=torch.ones(batch, 1, dtype=torch.bool, device=on),
    )


class _Passes:
    """What plain and speculative search share: the target's passes, their counts, and the rule
    that turns a pass's outputs into each scored node's best candidates."""

    def __init__(self, target: Target, cache, roots, tokens, lengths, config, constraint, width):
        self.target, self.cache = target, cache
        # [B, 1, V] the roots' outputs where the prefill gave them (None: a pass scores the
        # roots, the prompts' last tokens, which the prefill then left uncached)
        self.roots = roots
        self.prompt_tokens, self.prompt_lengths = tokens, lengths  # [B, T], [B]
        self.config, self.constraint = config, constraint
        self.width = width  # C: the best next tokens a node keeps
        self.normalized = getattr(target, "outputs_log_probs", False)  # read as they are
        # A catalogue's forced token costs exactly 0 where log-probs are renormalised over the
        # allowed tokens (by the rule, or by the target's own outputs): known without a pass.
        free = config.renormalize or getattr(target, "forced_tokens_free", False)
        self.forced_free = isinstance(constraint, Catalogue) and free
        self.speculative = self.drafted = self.saved = 0
        self.passes = int(roots is not None)  # a prefill that scored the roots is their pass
        # Summed on the device and read once, at the end (a read per step makes a GPU wait)
        on = tokens.device
        self.nodes = torch.zeros((), dtype=torch.long, device=on)  # real nodes scored
        self.row_steps = torch.zeros((), dtype=torch.long, device=on)
        self.nan = torch.zeros((), dtype=torch.bool, device=on)  # a live beam read NaN
        # (nodes planned for the beams, nodes drafted) of each pass that had a drafter
        self.drafted_passes: list[tuple[int, int]] = []

    @cached_property
    def prompts(self) -> list[list[int]]:
        """The rows' prompts on the host, for a hook constraint (read once, when one asks)."""
        tokens, lengths = self.prompt_tokens.tolist(), self.prompt_lengths.tolist()
        return [row[:n] for row, n in zip(tokens, lengths, strict=True)]

    def check_finite(self) -> None:
        """Refuse the search's output if a live beam read NaN log-probs, which NaN logits give
        (checked once, at the end: a check per step would make a GPU wait on every step)."""
        if bool(self.nan):
            raise DecodeInputError(
                "the target's logits contain NaN",
                "check the model's weights and dtype (fp16 overflow is a common cause)",
            )

    def draft_counts(self) -> tuple[int, Tensor, Tensor]:
        """Nodes drafted; the live beams' nodes whose scores came from the target, and those of
        them a drafter proposed: none without a drafter."""
        none = self.nodes.new_zeros(())
        return self.drafted, none, none

    def root_candidates(self, states: Tensor) -> tuple[Tensor, Tensor, Tensor]:  # [B] -> [B, C']
        """The roots' best next tokens (``_best``; states: their constraint states) from the
        prefill's outputs, which it then lets go; each row's root counts as a node scored."""
        batch = len(states)
        rows = torch.arange(batch, device=states.device)
        free = self.constraint.trie.forced(states) >= 0 if self.forced_free else None
        best = self._best(self.roots[:, 0], None, rows, states, lambda: [[]] * batch, free)
        self.roots = None
        self.nodes += batch
        return best

    def _best(
        self,
        logits: Tensor,  # [N, V] the pass's nodes'
        at: Tensor | None,  # [Q] the logits row of each node scored (None: all N, in order)
        rows: Tensor,  # [Q] their rows
        states: Tensor,  # [Q] their constraint states
        paths: Callable[[], list[list[int]]],  # their generated tokens (a hook reads them)
        free: Tensor | None = None,  # [Q] bool forced nodes, whose one candidate costs 0
    ) -> tuple[Tensor, Tensor, Tensor]:  # [Q, C' <= C] each: log-probs (-inf pads), tokens, states
        """The nodes' best next tokens under the constraint, and the state each leads to."""
        scores, choices, after = self._log_probs(logits, at, rows, states, paths)
        if free is not None:  # (a catalogue's: a forced node's one child is its first)
            scores[:, 0].masked_fill_(free, 0.0)
        if choices is not None:  # a catalogue's children: the best C of them
            if scores.shape[1] > self.width:  # (a call's nodes are as wide as its widest,
                # which differs between plain and speculative search: ties in place order)
                scores, index = stable_top(scores, self.width)
                choices, after = choices.gather(1, index), after.gather(1, index)
        elif scores.shape[1] > self.width:  # a vocabulary's rows, V wide in plain and
            # speculative search alike, where ``topk`` orders ties alike and costs less
            scores, choices = scores.topk(self.width)
        else:  # every token fits: kept as they are, in token order
            choices = torch.arange(scores.shape[1], device=scores.device).expand_as(scores)
        if after is None:  # the constraint's own step (none: every state stays 0)
            after = states[:, None].expand_as(choices)
            if self.constraint is not None:
                after = self.constraint.advance(after, choices)
        return scores, choices, after

    def _log_probs(
        self, logits: Tensor, at: Tensor | None, rows: Tensor, states: Tensor, paths
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """``_best``'s log-probabilities [Q, C], all of them, their tokens (None: 0..V-1) and
        states (None: not known yet); a catalogue reads only each node's children, and their
        nodes."""
        if isinstance(self.constraint, Catalogue):
            return catalogue_log_probs(
                logits, self.constraint.trie, states, self.config.renormalize, self.normalized, at
            )
        logits = logits if at is None else logits[at]
        if self.constraint is None:
            return log_probs(logits, None, self.config.renormalize, self.normalized), None, None

        def sequences() -> list[list[int]]:  # each node's prompt and generated tokens
            where = rows.tolist()
            return [self.prompts[r] + path for r, path in zip(where, paths(), strict=True)]

        allowed = self.constraint.allowed(states, rows, sequences)
        return log_probs(logits, allowed, self.config.renormalize, self.normalized), None, None


class _PlainSearch(_Passes):
    """Plain beam search: a pass scores the live beams' new nodes, each beam's in a fixed slot
    (beam w's node is the w-th of the step's W; the first step's, the W copies of the root, is
    one), so no node is ever looked up: the candidates go from the pass's outputs straight to
    the selection. A step whose live nodes are all known forced ones needs no pass: they wait
    for the next, which carries them as their children's ancestors."""

    def __init__(self, *passes, drafter: StepDrafter | None = None):  # passes: _Passes' own
        super().__init__(*passes)
        self.size = 0  # nodes in the target's pending tree
        self.slots = torch.arange(self.config.num_beams, device=self.prompt_tokens.device)  # [W]
        self.waiting: list[tuple[Tensor, Tensor, Tensor]] = []  # steps' unscored nodes (below)
        # A target that reads a step's candidates itself under a catalogue (the recommender: its
        # tree from the beams' levels, each beam's children off its level's outputs), without
        # the pending tree and vocabulary-wide outputs of ``grow_tree``
        self.stepwise = (
            isinstance(self.constraint, Catalogue)
            and hasattr(self.target, "beam_candidates")
            and self.roots is None
        )
        if drafter is not None and not self.stepwise:
            raise DecodeInputError(
                "this drafter drafts for a target's own step read (beam_candidates), which "
                "this search has not (a target without one, or no catalogue constraint)",
                "decode the recommender's target under its catalogue, or use a tree drafter "
                "(CatalogueDrafter, PromptLookupDrafter)",
            )
        self.drafter = drafter

    def draft_counts(self) -> tuple[int, Tensor, Tensor]:
        """The step drafter's counts (``StepDrafter.counts``), if the search has one."""
        return super().draft_counts() if self.drafter is None else self.drafter.counts()

    def candidates(
        self, beams: _Beams, open_rows: Tensor, alive: Tensor, step: int
    ) -> tuple[Tensor, Tensor, Tensor]:  # open_rows [B], alive [B, W] bool -> [B, W, C] each
        """The beams' new nodes' best next tokens, from a pass where a live one needs it (at the
        first step the root's, [B, 1, C])."""
        if self.stepwise:
            got = self.target.beam_candidates(
                self.cache, step, beams.last, beams.origin, beams.states, alive,
                self.constraint.trie, self.drafter,
            )  # fmt: skip
            if got.passes:
                self.passes += 1
                self.speculative += int(self.drafter is not None)
                self.nodes += got.nodes
            # Every child: the selection's one pick over the step's whole table (`stable_top`,
            # in place order) keeps what each node's best C and a pick among those would, and
            # costs less (a top C of each node's children is a sort per node)
            return got.values, got.tokens, got.states
        step_nodes = beams.last, beams.parents, beams.states, alive  # [B, W] each
        if step == 0:  # the first step's beams are copies of the root: one node
            step_nodes = tuple(part[:, :1] for part in step_nodes)
        tokens, parents, states, live = step_nodes  # [B, n] each
        if self.roots is not None:  # the roots, scored and cached by the prefill: the step's
            # children hang under the cached prompt (parent -1)
            beams.nodes = torch.full_like(beams.last, -1)
            return tuple(part[:, None] for part in self.root_candidates(states[:, 0]))
        first = self.size + sum(part[0].shape[1] for part in self.waiting)  # the step's 1st node
        # [B, W] beam w's node is the step's w-th (the root copies' its only one)
        nodes = self.slots + first if step else torch.full_like(beams.last, first)
        beams.nodes = nodes.expand_as(beams.last)
        forced = self.constraint.trie.forced(states) if self.forced_free else None  # [B, n]
        need = live if forced is None else live & (forced < 0)
        self.waiting.append((tokens, parents, live))
        if bool(need.any()):

            def sequences() -> Tensor:  # [B, n, step] the step nodes' generated tokens
                return beams.sequences[:, : tokens.shape[1], :step]

            free = None if forced is None else forced >= 0  # [B, n] forced: a read costs 0
            values, options, after = self._pass(need, states, sequences, free)
        elif forced is not None:  # every live node is a forced one: the same, without a pass
            values = torch.zeros(*forced.shape, 1, device=forced.device)
            options = forced.clamp_min(0)[..., None]
            after = self.constraint.trie.forced_child(states)[..., None]
        else:  # no live node: no candidates
            values = torch.full((*tokens.shape, 1), float("-inf"), device=tokens.device)
            options = torch.zeros_like(values, dtype=torch.long)
            after = torch.full_like(options, -1)
        return values, options, after

    def _pass(
        self,
        need: Tensor,  # [B, n] bool the step's nodes whose outputs the target must give
        states: Tensor,  # [B, n] their constraint states
        sequences: Callable[[], Tensor],  # [B, n, T] their generated tokens (a hook reads them)
        free: Tensor | None,  # [B, n] bool the forced nodes (their one candidate costs 0)
    ) -> tuple[Tensor, Tensor, Tensor]:  # [B, n, C] each: -inf (token 0, state -1) not read
        """One target pass over the waiting nodes and the step's (the last n of it), and the
        step nodes' candidates. Under a catalogue every step node is read, needed or not (a
        node's children cost a gather, and one read in order costs less than picking some):
        a forced one's candidate gets its 0 here, a dead beam's is masked by the caller."""
        batch, n = need.shape
        if len(self.waiting) == 1:  # the step's nodes alone
            (tokens, parents, live), needed = self.waiting[0], need
        else:
            tokens, parents, live = (torch.cat(part, 1) for part in zip(*self.waiting, strict=True))
            needed = torch.zeros_like(live)
            needed[:, -n:] = need
        self.waiting = []
        logits = self.target.grow_tree(self.cache, tokens, parents, needed)  # [B, M, V]
        self.size += tokens.shape[1]
        self.passes += 1
        self.nodes += live.sum()
        m = tokens.shape[1]
        read = torch.ones_like(need) if isinstance(self.constraint, Catalogue) else need
        rows, beam = read.nonzero(as_tuple=True)  # [Q] the nodes read, each one's slot
        # [Q] each one's row of the logits (None: every node of the pass, in order)
        at = None if m == n and len(rows) == read.numel() else rows * m + m - n + beam

        def paths() -> list[list[int]]:
            return sequences()[rows, beam].tolist()

        free = None if free is None else free[rows, beam]
        best = self._best(logits.flatten(0, 1), at, rows, states[rows, beam], paths, free)
        shape = (batch, n, best[0].shape[1])
        if len(rows) == read.numel():  # every step node, in order
            return tuple(part.reshape(shape) for part in best)
        values, options = best[0].new_full(shape, float("-inf")), best[1].new_zeros(shape)
        after = best[2].new_full(shape, -1)
        for table, part in zip((values, options, after), best, strict=True):
            table[rows, beam] = part
        return values, options, after


class _TreeSearch(_Passes):
    """Speculative beam search: the scored tree and the passes that grow it, a drafter adding
    nodes below the beams to each."""

    def __init__(
        self,
        target: Target,
        cache,
        roots,
        tokens,
        lengths,
        config,
        constraint,
        width,
        drafter,
        steps,
    ):
        super().__init__(target, cache, roots, tokens, lengths, config, constraint, width)
        self.drafter = drafter
        # Keys pack tokens below this: generated ones, and the roots' (prompt tokens, which a
        # recommender draws from its items, not its codes).
        tokens_below = max(target.vocab_size, getattr(target, "prompt_vocab_size", 0))
        # The beams add at most W nodes per row a step (and the root): room for them all from
        # the start; drafted nodes grow the tree past it.
        capacity = min(1 + config.num_beams * steps, MAX_NODES)
        self.tree = BeamTree(
            tokens.shape[0], width, tokens_below, capacity, tokens.device, constraint, steps
        )
        # (the beams' nodes, alive) [B, W] of every step after the first: its hits, counted
        # at the end (`draft_counts`)
        self.read: list[tuple[Tensor, Tensor]] = []
        # Tree nodes before the target's first grown one: the roots, where the prefill scored
        # (and cached) them, stored here as one closed pass
        self.cached = 0
        if roots is not None:
            self._store_roots(tokens, lengths)

    def _store_roots(self, tokens: Tensor, lengths: Tensor) -> None:  # [B, T], [B]
        """Plan the roots as the tree's first pass and store their candidates from the
        prefill's outputs."""
        rows = torch.arange(tokens.shape[0], device=tokens.device)
        last = tokens.gather(1, (lengths - 1)[:, None])[:, 0]  # [B] the prompts' last tokens
        nodes = self.tree.add(rows, torch.full_like(rows, -1), last)
        self.tree.plan()
        self.tree.store(rows, nodes, *self.root_candidates(self.tree.states[rows, nodes]))
        self.cached = 1

    def candidates(
        self, beams: _Beams, open_rows: Tensor, alive: Tensor, step: int
    ) -> tuple[Tensor, Tensor, Tensor]:  # open_rows [B], alive [B, W] bool -> [B, W, C] each
        """The beams' nodes' stored candidates, after a pass where a live one has none."""
        if step == 0 and self.cached:  # the roots, stored from the prefill
            beams.nodes = torch.zeros_like(beams.last)
            return self.tree.candidates(beams.nodes)
        if step:  # (the first step's beams are the roots, none scored yet)
            self.find_nodes(beams)
        self.score_beams(beams, open_rows, alive, first=step == 0)
        if step:  # the hits are counted once, at the end (the nodes' flags are final)
            self.read.append((beams.nodes, alive))
        return self.tree.candidates(beams.nodes)

    def find_nodes(self, beams: _Beams) -> None:
        """Point every beam at its scored (or planned) node, where it has one (-1: none yet)."""
        rows = torch.arange(beams.last.shape[0], device=beams.last.device)[:, None]
        found = self.tree.child(
            rows.expand_as(beams.last).flatten(), beams.parents.flatten(), beams.last.flatten()
        )
        beams.nodes = found.view(beams.last.shape)

    def score_beams(self, beams: _Beams, open_rows: Tensor, alive: Tensor, first: bool) -> None:
        """One pass when an open row has a live beam (alive [B, W]) whose node is not scored:
        those nodes, and the drafter's nodes below every live beam of the open rows. The
        ``first`` step's beams are W copies of each row's root (all but one scored
        UNREACHABLE): one node a row."""
        need = alive & (beams.nodes < 0)
        if first:
            need = need[:, :1]
        if not bool(need.any()):
            self.saved += self._scored_by_drafts(beams, alive)
            return
        tree = self.tree
        at = need.nonzero(as_tuple=True)  # the beams with a new node: rows, places
        rows, parents, tokens = at[0], beams.parents[at], beams.last[at]
        states = beams.states[at]
        # Copies of a beam (scored UNREACHABLE) share its nodes; after the first step a live
        # one is rare (beams from the root's copies where a catalogue is narrower than 2W)
        copies = not first and bool((beams.scores[alive] <= UNREACHABLE / 2).any())
        if copies:  # the beams that share a node plan it once
            once, copy_of = _distinct(tree.key(rows, parents, tokens))
            rows, parents, tokens, states = rows[once], parents[once], tokens[once], states[once]
        mark = len(tree.added)
        nodes = tree.add(rows, parents, tokens, states)
        beams.nodes[at] = nodes[copy_of] if copies else nodes
        if first:  # every copy of the root at its node
            beams.nodes = beams.nodes[:, :1].expand_as(beams.nodes).contiguous()
        if self.forced_free and bool((self.constraint.trie.forced(states) >= 0).all()):
            self._know_forced(rows, nodes)
            return  # no new node needs the target: they wait for a pass
        if self.drafter is not None:
            budget = max(1, self.config.draft_nodes // int(open_rows.sum()))
            if first:  # the frontier: each row's root
                rows_live, nodes_live = rows, nodes
            else:
                rows_live, nodes_live = alive.nonzero()[:, 0], beams.nodes[alive]
            if copies:  # the frontier lists a shared node once
                once, _ = _distinct(rows_live * MAX_NODES + nodes_live)
                rows_live, nodes_live = rows_live[once], nodes_live[once]
            beams_added = len(tree.added)
            self.drafter.draft(tree, rows_live, nodes_live, budget, self.cache)
            drafted = tree.added_since(beams_added)
            tree.drafted[drafted] = True
            self.drafted += len(drafted[0])
            self.drafted_passes.append((tree.count_added(beams_added), len(drafted[0])))
        if self.forced_free:  # the new forced nodes, the beams' and drafted: exactly 0, known
            self._know_forced(*tree.added_since(mark))
        self.speculative += self.drafter is not None
        self._pass()

    def _scored_by_drafts(self, beams: _Beams, alive: Tensor) -> bool:
        """Whether a step that needs no pass owes it to drafts: a live beam's node was scored
        by the target (without drafts, only a step whose new nodes are all known forced ones
        needs no pass)."""
        return bool((alive & ~self.tree.known.gather(1, beams.nodes.clamp_min(0))).any())

    def draft_counts(self) -> tuple[int, Tensor, Tensor]:
        """Nodes drafted; the live beams' nodes whose scores came from the target, over the
        search, and those of them a drafter proposed (a forced node's are known, not read)."""
        if not self.read:
            return super().draft_counts()
        nodes, alive = (torch.cat(part, 1) for part in zip(*self.read, strict=True))
        nodes = nodes.clamp_min(0)
        needed = alive & ~self.tree.known.gather(1, nodes)
        return self.drafted, needed.sum(), (needed & self.tree.drafted.gather(1, nodes)).sum()

    def _know_forced(self, rows: Tensor, nodes: Tensor) -> None:  # [Q] planned nodes each
        """Store the candidates of the planned nodes whose token is forced."""
        states = self.tree.states[rows, nodes]
        forced = self.constraint.trie.forced(states)  # [Q] -1: a choice
        at = (forced >= 0).nonzero()[:, 0]
        if len(at):
            after = self.constraint.trie.forced_child(states[at])
            self.tree.know(rows[at], nodes[at], forced[at], after)

    def _pass(self) -> None:
        """Score the planned nodes and store their best candidates."""
        tree = self.tree
        tokens, parents, real = tree.plan()
        needed = real & ~tree.known[:, tree.size - tokens.shape[1] : tree.size]  # [B, M]
        # The target numbers its grown nodes from its first, a cached root being parent -1
        parents = (parents - self.cached).clamp_min(-1)
        logits = self.target.grow_tree(self.cache, tokens, parents, needed)
        rows, slots = needed.nonzero(as_tuple=True)  # [Q] the nodes to store
        self.passes += 1
        self.nodes += real.sum()
        # [Q] each node's row of the logits (none when they are all of them, in order)
        at = None if len(rows) == needed.numel() else rows * needed.shape[1] + slots
        nodes = tree.size - tokens.shape[1] + slots

        def paths() -> list[list[int]]:
            return tree.paths(rows.tolist(), nodes.tolist())

        states = tree.states[rows, nodes]
        tree.store(rows, nodes, *self._best(logits.flatten(0, 1), at, rows, states, paths))


def _distinct(keys: Tensor) -> tuple[Tensor, Tensor]:  # [Q] -> [F], [Q]
    """The positions of the first occurrence of each distinct key, in order, and for each key
    the number of its distinct key among them."""
    ordered, order = keys.sort(stable=True)
    first = torch.ones_like(ordered, dtype=torch.bool)
    first[1:] = ordered[1:] != ordered[:-1]
    group = first.cumsum(0) - 1  # [Q] the distinct key of each sorted position
    starts = order[first]  # [F] each distinct key's first position, in key order
    positions, rank = starts.sort()  # rank: the key order of each distinct key, by position
    number = torch.empty_like(rank)
    number[rank] = torch.arange(len(rank), device=rank.device)
    copy_of = torch.empty_like(keys)
    copy_of[order] = number[group]
    return positions, copy_of


def _running(
    beams: _Beams, config: BeamConfig, every_row: Tensor | None
) -> tuple[Tensor, Tensor]:  # [B], [B, W] bool
    """The rows still searching and their live beams (every_row [B]: a search without end
    tokens, where no row stops early)."""
    alive = beams.scores > float("-inf")
    if every_row is not None:
        return every_row, alive
    open_rows = beams.improvable[:, 0]
    if config.early_stopping is True:  # a row with W finished hypotheses is done
        open_rows = open_rows & ~beams.done.all(1)
    return open_rows, alive & open_rows[:, None]


def _select(
    beams: _Beams,
    values: Tensor,  # [B, W, C] each beam's best next-token log-probs (-inf: none)
    options: Tensor,  # [B, W, C] their tokens (int32)
    after: Tensor,  # [B, W, C] the constraint states they lead to
    eos: Tensor,  # [E] eos token ids
    keep: int,  # candidates kept a step (2W with one eos token, W without end tokens)
    step: int,  # tokens generated before this step
    max_new_tokens: int,
    config: BeamConfig,
) -> Tensor | bool:  # whether every candidate kept ended (bool: none can end this step)
    """One step of transformers' beam search (``_get_top_k_continuations``, then
    ``_get_running_beams_for_next_iteration`` and ``_update_finished_beams``), in place."""
    batch, n, c = values.shape  # n: W, or 1 (the root's candidates, for its W copies)
    w = beams.scores.shape[1]
    # Without end tokens no candidate ends before the last step, where every one does: the
    # best W (`keep`) run on at every step, and the last step's best W are the finished
    # hypotheses (of one length, which the length penalty keeps in order): transformers'
    # result, whose 2W and finished set change nothing there but which of tied candidates come
    # first. Else the best 2W, as transformers keeps from its W x V (so where the step's nodes
    # have fewer candidates, -inf pads make up the 2W, and the tables below are as wide as
    # transformers' whatever C is).
    at_once = not len(eos)
    # The first step's beams are copies of the root, all but the first UNREACHABLE: where the
    # first has `keep` candidates, they are the step's best (in place order, first), so its
    # table needs no copies (a wide beam's W x C of them cost more than all the rest).
    if n < w and (c < keep or bool((values[:, 0] > float("-inf")).sum(1).min() < keep)):
        values, options, after = (part.expand(batch, w, c) for part in (values, options, after))
    flat = (beams.scores[:, : values.shape[1], None] + values).flatten(1)  # [B, n * C]
    candidates = flat.shape[1]
    if candidates < keep:
        flat = torch.nn.functional.pad(flat, (0, keep - candidates), value=float("-inf"))
    scores, index = stable_top(flat, keep)  # [B, keep]
    if candidates < keep:  # a pad reads the last candidate (its score stays -inf)
        index = index.clamp(max=candidates - 1)
    origin = index // c
    token, state = options.flatten(1).gather(1, index).long(), after.flatten(1).gather(1, index)
    if at_once:
        _run_on(beams, scores, origin, token, state, step)
        if step + 1 < max_new_tokens:
            return False
        _finish_all(beams, step + 1, config)
        return True
    # (a comparison with each eos token: isin costs ten times more on a step's few candidates)
    hits = (token[..., None] == eos).any(-1) | (step + 1 >= max_new_tokens)
    # Finished: those of the top W that ended, if they beat the worst finished hypothesis.
    ended = hits & (torch.arange(keep, device=hits.device) < w)
    if bool(ended.any()):  # most steps of an LLM's search: the finished ones stay as they are
        sequences = beams.sequences.gather(1, origin[..., None].expand(-1, -1, max_new_tokens))
        sequences[:, :, step] = token
        _finish(beams, scores, sequences, state, ended, step, config)
    if step + 1 >= max_new_tokens:  # the search's last step: no beam runs on
        return True
    # Running: the best W that did not end.
    running = scores + hits.float() * UNREACHABLE
    # (transformers' topk on the same 2W scores: equal ties break alike)
    pick = running.topk(w, dim=1).indices
    kept = (part.gather(1, pick) for part in (running, origin, token, state))
    _run_on(beams, *kept, step)
    # (-inf: no candidate, as many as the step's layout pads, so they count for neither)
    return (hits | (scores == float("-inf"))).all()


def stable_top(scores: Tensor, keep: int) -> tuple[Tensor, Tensor]:  # [R, N] -> [R, keep] each
    """Each row's best ``keep`` scores, best first, and their places, equal scores in place
    order: a stable descending sort's first ``keep``, at a ``topk``'s cost where no two kept
    scores tie. ``topk`` orders ties as its algorithm meets them, which depends on the row's
    length; a step's candidates are laid out C to a beam, C the widest node's, which differs
    between plain and speculative search (and ties are common: the root's copies, scored about
    UNREACHABLE, tie in float32). In place order both searches keep the same candidates.
    A small table is sorted outright: there one stable sort costs less than the ``topk`` and
    the test for ties (``SORT_SCORES``)."""
    if scores.numel() <= SORT_SCORES:
        values, places = scores.sort(dim=1, descending=True, stable=True)
        return values[:, :keep], places[:, :keep]
    values, places = scores.topk(keep, dim=1)
    edge = values[:, -1:]  # [R, 1] the worst kept
    # Equal neighbours among the kept (sorted; -inf pairs, no candidates, differ by NaN), or
    # more scores at the edge than kept there (unless the edge is -inf: which of those a step
    # keeps changes no result)
    ties = (values.diff(dim=1) == 0).any()
    ties |= (((scores >= edge).sum(1, keepdim=True) > keep) & (edge > float("-inf"))).any()
    if not bool(ties):
        return values, places
    scores = scores.nan_to_num(nan=float("-inf"))  # (NaN, refused after the search, ties none)
    edge = scores.topk(keep, dim=1).values[:, -1:]
    above, at_edge = scores > edge, scores == edge
    kept = above | (at_edge & (at_edge.cumsum(1) <= keep - above.sum(1, keepdim=True)))
    places = kept.nonzero()[:, 1].view(len(scores), keep)  # each row's, in place order
    values = scores.gather(1, places)
    order = values.sort(dim=1, descending=True, stable=True).indices
    return values.gather(1, order), places.gather(1, order)


def _run_on(
    beams: _Beams,
    scores: Tensor,  # [B, W] the running beams' new scores
    origin: Tensor,  # [B, W] the beam each extends
    last: Tensor,  # [B, W] the token it adds
    states: Tensor,  # [B, W] the constraint state after it
    step: int,
) -> None:
    """The running beams, one token longer."""
    beams.scores, beams.origin, beams.last, beams.states = scores, origin, last, states
    beams.sequences = beams.sequences.gather(1, origin[..., None].expand_as(beams.sequences))
    beams.sequences[:, :, step] = last
    beams.parents = beams.nodes.gather(1, origin)


def _finish(
    beams: _Beams,
    scores: Tensor,  # [B, 2W] the step's best candidates' summed log-probs
    sequences: Tensor,  # [B, 2W, T] their tokens
    states: Tensor,  # [B, 2W] their constraint states
    ended: Tensor,  # [B, 2W] bool those of the top W that ended
    step: int,
    config: BeamConfig,
) -> None:
    """The ended candidates enter the finished hypotheses where they beat the worst."""
    w = beams.done.shape[1]
    penalised = scores / ((step + 1) ** config.length_penalty)
    full = beams.done.all(1, keepdim=True) & (config.early_stopping is True)
    penalised += full.float() * UNREACHABLE
    penalised += (~beams.improvable).float() * UNREACHABLE
    penalised += (~ended) * UNREACHABLE
    merged = torch.cat([beams.done_scores, penalised], dim=1)
    # (transformers' topk on the same W + 2W scores: equal ties break alike)
    best = merged.topk(w, dim=1).indices
    lengths = torch.full_like(ended, step + 1, dtype=torch.long)
    beams.done_scores = merged.gather(1, best)
    beams.done_sequences = torch.cat([beams.done_sequences, sequences], 1).gather(
        1, best[..., None].expand(-1, -1, sequences.shape[2])
    )
    beams.done_lengths = torch.cat([beams.done_lengths, lengths], 1).gather(1, best)
    beams.done_states = torch.cat([beams.done_states, states], 1).gather(1, best)
    beams.done = torch.cat([beams.done, ended], 1).gather(1, best)


def _finish_all(beams: _Beams, length: int, config: BeamConfig) -> None:
    """Every running beam ends (the last step of a search without end tokens); a beam with no
    candidate (-inf) leaves its slot empty, as a finished set not filled keeps it."""
    real = beams.scores > float("-inf")  # [B, W]
    beams.done_scores = torch.where(real, beams.scores / length**config.length_penalty, UNREACHABLE)
    beams.done_sequences = beams.sequences
    beams.done_lengths = real.long() * length
    beams.done_states = beams.states.masked_fill(~real, -1)
    beams.done = real


def _unfinished(
    beams: _Beams, all_ended: Tensor | bool, generated: int, max_new_tokens: int, config: BeamConfig
) -> bool:
    """transformers' ``_check_early_stop_heuristic`` and stopping rule, after a step
    (``all_ended`` False: no candidate could end in it)."""
    if all_ended is False:  # nothing has finished yet, so no row can stop: no host read
        return True
    never = config.early_stopping == "never" and config.length_penalty > 0.0
    best_length = max_new_tokens if never else generated
    best_possible = beams.scores[:, :1] / (best_length**config.length_penalty)
    worst = torch.where(beams.done, beams.done_scores.min(1, keepdim=True).values, UNREACHABLE)
    beams.improvable &= (best_possible > worst).any(1, keepdim=True)
    stop = ~beams.improvable.any() | all_ended  # one host sync a step (a GPU waits on each)
    if config.early_stopping is True:
        stop |= beams.done.all()
    return not bool(stop)


def _output(beams: _Beams, k: int, search: _Passes, wall_time_s: float) -> BeamOutput:
    lengths = beams.done_lengths[:, :k].flatten()  # [B * K]
    columns = torch.arange(beams.done_sequences.shape[2], device=lengths.device)
    mask = columns < lengths[:, None]
    offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
    # The counters summed on the device, read in one transfer
    drafted, *hit_counts = search.draft_counts()
    counts = torch.stack([lengths.sum(), search.row_steps, search.nodes, *hit_counts])
    generated, row_steps, nodes, needed, hits = counts.tolist()
    stats = DecodeStats(
        target_forwards=search.passes,
        speculative_forwards=search.speculative,
        generated_tokens=generated,
        row_steps=row_steps,
        drafted_per_position=(),
        accepted_per_position=(),
        wall_time_s=wall_time_s,
        nodes_scored=nodes,
        draft_nodes=drafted,
        needed_nodes=needed,
        draft_hits=hits,
    )
    values = beams.done_sequences[:, :k].flatten(0, 1)[mask]
    return BeamOutput(
        values=values,
        offsets=offsets,
        stats=stats,
        scores=beams.done_scores[:, :k],
        states=beams.done_states[:, :k],
    )
