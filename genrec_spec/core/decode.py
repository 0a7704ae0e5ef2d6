"""The one decoding loop: propose a tree -> score it in one target forward -> accept a path ->
commit the KV cache -> repeat. Plain autoregressive decoding is the same loop with the
root-only tree. Where the target scores the prompt's last token in its prefill
(``scores_prefill``), the first step is that root-only tree with the prefill's logits: no pass.

Every row of the batch moves at its own pace (its own accepted length, prompt length, end of
sequence); finished rows stay in the batch, frozen, until all rows are done. The loop reads
values on the host once per step (finished rows, NaN check, controller counts).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from numbers import Integral

import torch
from torch import Tensor

from genrec_spec.core.acceptance import AcceptanceRule, GreedyMatch, RejectionSampling
from genrec_spec.core.constraints import ConstrainedTrees, Constraint, check_catalogue
from genrec_spec.core.controller import ControllerConfig, SpeculationController
from genrec_spec.core.targets import Target, as_target
from genrec_spec.core.tree import root_only
from genrec_spec.core.types import (
    DecodeInputError,
    DecodeState,
    DecodeStats,
    Generation,
    Proposer,
    SamplingParams,
    write_ragged,
)


def pack_prompts(
    input_ids: Tensor | Sequence[Sequence[int]] | Sequence[Tensor],
    prompt_lengths: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Prompts as right-padded tokens [B, T] and lengths [B]. Accepts a [B, T] tensor (with
    optional prompt_lengths [B] for right padding) or one token sequence per row."""
    if isinstance(input_ids, Tensor):
        if input_ids.dim() != 2:
            raise DecodeInputError(
                f"input_ids has shape {tuple(input_ids.shape)}",
                "pass a [B, T] tensor of token ids or a list of prompts",
            )
        if (
            input_ids.dtype.is_floating_point
            or input_ids.dtype.is_complex
            or (input_ids.dtype == torch.bool)
        ):
            raise DecodeInputError(
                f"input_ids are {input_ids.dtype}, not token ids",
                "pass an integer tensor (torch.long) of token ids",
            )
        tokens = input_ids.long()
        if prompt_lengths is not None and tuple(prompt_lengths.shape) != (tokens.shape[0],):
            raise DecodeInputError(
                f"prompt_lengths has shape {tuple(prompt_lengths.shape)} for {tokens.shape[0]} "
                "prompts",
                "pass one length per row of input_ids: a [B] tensor",
            )
        lengths = (
            torch.full((tokens.shape[0],), tokens.shape[1], device=tokens.device)
            if prompt_lengths is None
            else prompt_lengths.to(tokens.device).long()
        )
    else:
        rows = [row.tolist() if isinstance(row, Tensor) else list(row) for row in input_ids]
        if not rows:
            raise DecodeInputError("no prompts given", "pass at least one prompt")
        odd = [(b, t) for b, row in enumerate(rows) for t in row if not isinstance(t, Integral)]
        if odd:
            raise DecodeInputError(
                f"prompt {odd[0][0]} holds {odd[0][1]!r} ({type(odd[0][1]).__name__}), not a "
                "token id",
                "pass token ids (e.g. tokenizer(text).input_ids, or apply_chat_template(..., "
                "tokenize=True, return_dict=False))",
            )
        width = max(len(row) for row in rows)
        # On the host, where the lists are: a decode moves them to its target's device
        lengths = torch.tensor([len(row) for row in rows], device="cpu")
        tokens = torch.tensor(
            [row + [0] * (width - len(row)) for row in rows], dtype=torch.long, device="cpu"
        ).view(len(rows), width)
    if tokens.shape[0] == 0 or tokens.shape[1] == 0 or bool((lengths < 1).any()):
        raise DecodeInputError(
            "a prompt is empty", "give every row at least one token (e.g. a BOS token)"
        )
    if bool((lengths > tokens.shape[1]).any()) or bool((tokens < 0).any()):
        raise DecodeInputError(
            "prompt_lengths exceed the tokens given, or a token id is < 0",
            "pass prompt_lengths <= input_ids.shape[1] and ids >= 0",
        )
    return tokens, lengths


def _check_limits(target: Target, lengths: Tensor, max_new_tokens: int) -> None:
    if max_new_tokens < 1:
        raise DecodeInputError(f"max_new_tokens is {max_new_tokens}", "ask for at least 1 token")
    longest = int(lengths.max())
    if longest + max_new_tokens > target.max_length:
        raise DecodeInputError(
            f"a prompt of {longest} tokens plus max_new_tokens={max_new_tokens} exceeds the "
            f"target's context of {target.max_length} tokens",
            "shorten the prompt or lower max_new_tokens",
        )


def check_end_tokens(eos: list[int], vocab_size: int | None) -> None:
    """End tokens must be token ids the target can emit (one past its vocabulary would never
    end a row: a silent decode to max_new_tokens)."""
    bad = [t for t in eos if t < 0 or (vocab_size is not None and t >= vocab_size)]
    if bad:
        raise DecodeInputError(
            f"eos_token_id {bad[0]} is not a token of the target's vocabulary ({vocab_size})",
            "pass the tokenizer's end token id (e.g. tokenizer.eos_token_id), or None",
        )


def _check_vocab(target: Target, tokens: Tensor) -> None:
    # A target may read prompts in a vocabulary of their own (the recommender: item ids).
    vocab = getattr(target, "prompt_vocab_size", None) or target.vocab_size
    if int(tokens.max()) >= vocab:
        raise DecodeInputError(
            f"token id {int(tokens.max())} is outside the target's vocabulary of {vocab}",
            "tokenize with the target's own tokenizer",
        )


def generate(
    target: object,
    input_ids: Tensor | Sequence[Sequence[int]],
    *,
    proposer: Proposer | None = None,
    sampling: SamplingParams | None = None,
    max_new_tokens: int = 64,
    generator: torch.Generator | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    prompt_lengths: Tensor | None = None,
    acceptance: AcceptanceRule | None = None,
    controller: ControllerConfig | None = None,
    constraint: Constraint | None = None,
) -> Generation:
    """Generate up to max_new_tokens per row (fewer where an eos token ends the row).

    target: a Target, a genrec_spec Llama, a transformers causal LM (see ``as_target``).
    input_ids: [B, T] tensor (+ prompt_lengths [B] when right-padded) or one list per row.
    proposer: the drafter; None is plain autoregressive decoding.
    acceptance: defaults to GreedyMatch for greedy sampling, else RejectionSampling (both
    lossless: the output is distributed exactly as plain decoding with ``sampling``).
    constraint: what may be generated (a ``Catalogue``, ``AllowedTokens``); the target's
    logits are masked to it, so sampling draws from the constrained distribution exactly.
    Returns the generated tokens (ragged values + offsets) and DecodeStats.
    """
    sampling = sampling or SamplingParams()
    target = as_target(target)
    tokens, lengths = pack_prompts(input_ids, prompt_lengths)
    device = getattr(target, "device", tokens.device)
    tokens, lengths = tokens.to(device), lengths.to(device)
    _check_limits(target, lengths, max_new_tokens)
    rule = acceptance or (GreedyMatch() if sampling.greedy else RejectionSampling())
    eos = None if eos_token_id is None else torch.as_tensor(eos_token_id, device=device).flatten()
    eos_ids = [] if eos is None else eos.tolist()
    check_end_tokens(eos_ids, getattr(target, "vocab_size", None))
    check_catalogue(constraint, eos_ids, max_new_tokens, getattr(target, "vocab_size", None))
    started = time.perf_counter()
    with torch.inference_mode():
        state, scored = _prefill(
            target, tokens, lengths, max_new_tokens, proposer, sampling, generator
        )
        cache, batch = state.cache, tokens.shape[0]
        k_max = proposer.k if proposer is not None else 0
        control = SpeculationController(
            controller or ControllerConfig(), k_max, getattr(proposer, "draft_cost", 0.0), batch
        )
        counters = torch.zeros(2 + 2 * k_max, dtype=torch.long, device=tokens.device)
        forwards = speculative = 0
        longest = int(lengths.max())  # host-side bound on state.lengths.max()
        allowed = None if constraint is None else ConstrainedTrees(constraint, batch, device)
        while True:
            if scored is not None:  # the prefill scored the roots: the first step needs no pass
                budget, tree, logits = 0, root_only(state.roots), scored
            else:
                # Never draft past the target's context or past the last token still wanted.
                budget = min(control.budget(), target.max_length - longest, max_new_tokens - 1)
                tree = proposer.propose(state, budget) if budget > 0 else root_only(state.roots)
                logits = target.score_tree(cache, tree)  # [B, N, V]
            if allowed is not None:
                logits = allowed.mask(tree, logits, state.tokens, state.lengths)
            accepted = rule(tree, logits, sampling, generator)
            counts, done = _emitted(state, accepted, eos)
            active = ~state.finished
            all_done, widest, observed = _read_step(tree, logits, accepted, counts, done, active)
            if allowed is not None:
                allowed.advance(accepted.tokens[:, :widest], counts)
            if scored is None:  # (the prefill cached the roots already)
                target.commit(cache, accepted.path[:, :widest], counts)
            scored = None
            _advance(state, tree, logits, accepted, counts, done, widest, budget > 0)
            longest += widest
            forwards, speculative = forwards + 1, speculative + (budget > 0)
            counters += _step_counters(accepted, counts, active, k_max)
            control.update(budget, tree.num_nodes, *observed)
            if proposer is not None:
                proposer.observe(state, accepted)
            if all_done:
                break
        values, offsets = _outputs(state)
    row_steps, generated, *per_position = counters.tolist()
    stats = DecodeStats(
        target_forwards=forwards,
        speculative_forwards=speculative,
        generated_tokens=generated,
        row_steps=row_steps,
        drafted_per_position=tuple(per_position[:k_max]),
        accepted_per_position=tuple(per_position[k_max:]),
        wall_time_s=time.perf_counter() - started,
    )
    return Generation(values=values, offsets=offsets, stats=stats)


def _prefill(
    target: Target,
    tokens: Tensor,  # [B, T] right-padded prompts
    lengths: Tensor,  # [B]
    max_new_tokens: int,
    proposer: Proposer | None,
    sampling: SamplingParams,
    generator: torch.Generator | None,
) -> tuple[DecodeState, Tensor | None]:
    """The target's prefill of the prompts and the decode state around its cache; the
    proposer's ``begin`` has seen it (first: a proposer may size its draft cost by the batch).
    Also the prompts' last tokens' logits [B, 1, V] where the target scores them in its prefill
    (``scores_prefill``) and no proposer reads the prompt's hidden states (they describe the
    tokens a pass scored, which the prefill's would not), else None."""
    batch, width = tokens.shape
    hidden_layers = getattr(proposer, "hidden_layers", ())
    scores = getattr(target, "scores_prefill", False) and not hidden_layers
    cache, scored = prefill_checked(
        target, tokens, lengths, width + max_new_tokens, hidden_layers, scores
    )
    state = DecodeState(
        tokens=torch.cat([tokens, tokens.new_zeros(batch, max_new_tokens)], dim=1),
        lengths=lengths,
        prompt_lengths=lengths,
        finished=torch.zeros(batch, dtype=torch.bool, device=tokens.device),
        sampling=sampling,
        generator=generator,
        vocab_size=target.vocab_size,
        max_new_tokens=max_new_tokens,
        cache=cache,
    )
    if proposer is not None:
        proposer.begin(state)
    return state, scored


def prefill_checked(
    target: Target,
    tokens: Tensor,  # [B, T] right-padded prompts
    lengths: Tensor,  # [B]
    capacity: int,
    hidden_layers: Sequence[int] = (),
    scored: bool = False,
) -> tuple[object, Tensor | None]:  # the target's cache handle; prefill_scored's logits or None
    """``target.prefill`` (``prefill_scored`` when scored), the prompts' token ids checked
    against its vocabulary first, or, for a target that learns its vocabulary at prefill (a
    CallableTarget), right after."""
    vocab_known = target.vocab_size is not None
    if vocab_known:
        _check_vocab(target, tokens)
    if scored:
        cache, logits = target.prefill_scored(tokens, lengths, capacity)
    else:
        cache, logits = target.prefill(tokens, lengths, capacity, hidden_layers), None
    if not vocab_known:
        _check_vocab(target, tokens)
    return cache, logits


def _read_step(
    tree,
    logits: Tensor,  # [B, N, V]
    accepted,
    counts: Tensor,  # [B]
    done: Tensor,  # [B] bool
    active: Tensor,  # [B] bool, rows not finished before this step
) -> tuple[bool, int, list[int]]:
    """The one host read of the step: whether every row is done, the most tokens a row emits,
    and the controller's counts (active rows, drafted depth, accepted tokens, rejections).
    Raises on NaN logits or draft probabilities."""
    read = [
        done.all(),
        torch.isnan(logits).any(),
        _nan_draft(tree),
        counts.max(),
        active.sum(),
        (accepted.draft_depth * active).sum(),
        (accepted.num_accepted * active).sum(),
        ((accepted.num_accepted < accepted.draft_depth) & active).sum(),
    ]
    all_done, nan_logits, nan_draft, widest, *observed = torch.stack(
        [x.long() for x in read]
    ).tolist()
    if nan_logits or nan_draft:
        culprit = "target's logits" if nan_logits else "proposer's draft probabilities"
        raise DecodeInputError(
            f"the {culprit} contain NaN",
            "check the model's weights and dtype (fp16 overflow is a common cause)",
        )
    return bool(all_done), widest, observed


def _advance(
    state: DecodeState,
    tree,
    logits: Tensor,  # [B, N, V]
    accepted,
    counts: Tensor,  # [B] tokens each row emits
    done: Tensor,  # [B] bool
    widest: int,
    speculated: bool,
) -> None:
    """Append each row's emitted tokens to the state and record the step for the proposer."""
    state.tokens = write_ragged(state.tokens, state.lengths, accepted.tokens[:, :widest], counts)
    state.lengths = state.lengths + counts
    state.finished, state.counts = done, counts
    state.tree, state.logits, state.speculated = tree, logits, speculated


def _nan_draft(tree) -> Tensor:  # [] bool
    if tree.draft_probs is None:
        return torch.zeros((), dtype=torch.bool, device=tree.tokens.device)
    return torch.isnan(tree.draft_probs).any()


def _emitted(state: DecodeState, accepted, eos: Tensor | None) -> tuple[Tensor, Tensor]:
    """Tokens each row emits this step ([B]; 0 for finished rows), cut at max_new_tokens and
    after an eos token, and which rows are finished afterwards ([B] bool)."""
    remaining = state.max_new_tokens - (state.lengths - state.prompt_lengths)
    counts = torch.minimum(accepted.num_accepted + 1, remaining)
    hit_eos = torch.zeros_like(state.finished)
    if eos is not None:
        slots = torch.arange(accepted.tokens.shape[1], device=counts.device)
        is_eos = torch.isin(accepted.tokens, eos) & (slots < counts[:, None])
        hit_eos = is_eos.any(1)
        counts = torch.where(hit_eos, is_eos.long().argmax(1) + 1, counts)
    counts = torch.where(state.finished, 0, counts)
    done = state.finished | hit_eos | (counts >= remaining)
    return counts, done


def _step_counters(accepted, counts: Tensor, active: Tensor, k_max: int) -> Tensor:
    """[2 + 2K] per-step increments: row-steps, generated tokens, then drafted and accepted
    row-steps per draft position 1..K."""
    position = torch.arange(1, k_max + 1, device=counts.device)
    drafted = ((accepted.draft_depth[:, None] >= position) & active[:, None]).sum(0)
    kept = ((accepted.num_accepted[:, None] >= position) & active[:, None]).sum(0)
    head = torch.stack([active.sum(), counts.sum()])
    return torch.cat([head, drafted, kept])


def _outputs(state: DecodeState) -> tuple[Tensor, Tensor]:
    """Generated tokens as ragged values [sum] and offsets [B + 1]."""
    column = torch.arange(state.tokens.shape[1], device=state.tokens.device)
    mask = (column >= state.prompt_lengths[:, None]) & (column < state.lengths[:, None])
    sizes = state.lengths - state.prompt_lengths
    offsets = torch.cat([sizes.new_zeros(1), sizes.cumsum(0)])
    return state.tokens[mask], offsets
