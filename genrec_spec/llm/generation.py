"""Texts for a list of prompts, decoded plainly or with a speculative method of the registry
(`genrec_spec.llm.methods`), with the decoding statistics: what `genrec-spec generate` runs.
With ``num_beams`` > 1, each prompt's K best sequences by beam search (``core.beam``), plain or
drafting by prompt lookup (method ngram) where the record of earlier searches says it pays."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from genrec_spec.llm import methods

# Methods beam search can run: plain, or prompt lookup drafting below the beams
# (core.prompt_lookup.PromptLookupDrafter); the others propose single paths for generate().
BEAM_METHODS = ("none", "ngram")


@dataclass(frozen=True)
class GenerationConfig:
    """Defaults of ``genrec-spec generate``."""

    model: str = "smollm2"  # the target, one of methods.MODELS
    method: str = "none"  # a name of methods.METHODS
    drafter: Path | None = None  # trained drafter folder; None: the cache's drafters/<kind>
    chat: bool = False  # wrap each prompt in the model's chat template as a user turn
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int = 0
    batch_size: int = 1
    k: int | None = None  # draft depth; None: the method's default
    draft_layers: int = 10  # layers of the target the draft method keeps
    threads: int = 0  # torch CPU threads; 0: the fastest for the model and batch, measured
    pass_cost: str = "measured"  # the speculation controller's cost model: methods.PASS_COSTS
    tree_nodes: int | None = None  # EAGLE-2's tree (eagle2, eagle3); None: the defaults
    tree_top_k: int | None = None
    tree_depth: int | None = None
    # Beam search: W > 1 beams return each prompt's K best sequences (greedy only)
    num_beams: int = 1
    num_return_sequences: int = 1  # K <= W
    length_penalty: float = 1.0  # a finished sequence scores sum(log-probs) / length ** this


def generate_texts(prompts: list[str], config: GenerationConfig) -> dict:
    """Decode every prompt, ``config.batch_size`` at a time: ``{"results": [{"prompt", "text",
    "tokens"}], "batches": [DecodeStats.as_dict()], "summary": {...}}``; with beam search each
    result is its best sequence and adds "score" and "beams" (the K best, each a text, tokens
    and score). Bad settings are refused before any model is loaded."""
    import torch

    from genrec_spec.core.types import DecodeInputError, SamplingParams
    from genrec_spec.llm.threads import fastest_threads

    if config.batch_size < 1:
        raise DecodeInputError(f"--batch-size {config.batch_size}", "use --batch-size >= 1")
    if not 0 <= config.seed < 2**63:  # (torch's generator raised "Overflow when unpacking")
        raise DecodeInputError(f"--seed {config.seed}", "use a seed from 0 to 2**63 - 1")
    if config.k is not None and config.k < 1:
        raise DecodeInputError(
            f"--k {config.k}", "use --k >= 1 (a draft depth), or leave it out for the default"
        )
    sampling = SamplingParams(config.temperature, config.top_k, config.top_p)
    methods.check_method(config.model, config.method)
    methods.check_tree_options((config.method,), *_tree(config))
    if config.threads < 0:
        raise DecodeInputError(
            f"--threads {config.threads}", "use --threads >= 1, or 0 to measure the fastest"
        )
    check_beam_settings(
        config.num_beams, config.num_return_sequences, config.temperature, config.method
    )
    model, tokenizer = methods.load_target(config.model)
    torch.set_num_threads(config.threads or fastest_threads(model, config.batch_size))
    if config.chat:
        prompts = [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
            )
            for p in prompts
        ]
    beams = config.num_beams > 1
    decode = (
        _beam_decoder(model, tokenizer, config)
        if beams
        else _path_decoder(model, tokenizer, config, sampling)
    )
    results, batches = [], []
    for start in range(0, len(prompts), config.batch_size):
        chunk = prompts[start : start + config.batch_size]
        stats, rows = decode([tokenizer(p)["input_ids"] for p in chunk])
        batches.append(stats.as_dict())
        results += [{"prompt": p, **row} for p, row in zip(chunk, rows, strict=True)]
    return {
        "results": results,
        "batches": batches,
        "summary": summary(config.method, batches, beams=beams),
    }


def _tree(config: GenerationConfig) -> tuple:
    return config.tree_nodes, config.tree_top_k, config.tree_depth


def _path_decoder(model, tokenizer, config: GenerationConfig, sampling):
    """ids of a batch -> (DecodeStats, each row's {"text", "tokens"}) by ``generate``, plainly
    or with the method's proposer under the speculation controller."""
    import torch

    from genrec_spec.core.controller import cached_pass_cost
    from genrec_spec.core.decode import generate

    proposer = methods.make_proposer(
        config.method,
        model,
        config.k,
        config.draft_layers,
        config.drafter,
        config.model,
        tokenizer,
        *_tree(config),
    )
    controller = None  # plain decoding: nothing to control (and no pass cost to time)
    if proposer is not None:
        controller = methods.controller_for(config.pass_cost, lambda: cached_pass_cost(model))
    generator = torch.Generator().manual_seed(config.seed)

    def decode(ids: list[list[int]]):
        out = generate(
            model,
            ids,
            proposer=proposer,
            sampling=sampling,
            max_new_tokens=config.max_new_tokens,
            generator=generator,
            eos_token_id=tokenizer.eos_token_id,
            controller=controller,
        )
        rows = [{"text": tokenizer.decode(t), "tokens": len(t)} for t in out.tolist()]
        return out.stats, rows

    return decode


def _beam_decoder(model, tokenizer, config: GenerationConfig):
    """ids of a batch -> (DecodeStats, each row's best {"text", "tokens", "score"} and its K
    "beams") by beam search. Method ngram drafts by prompt lookup; its searches share one draft
    record, so later batches draft only if drafting paid in the earlier ones."""
    from genrec_spec.core.beam import BeamConfig
    from genrec_spec.core.prompt_lookup import PromptLookupDrafter

    drafter = record = None
    if config.method == "ngram":
        drafter = PromptLookupDrafter() if config.k is None else PromptLookupDrafter(config.k)
        record = methods.draft_record(model, config.pass_cost)
    settings = BeamConfig(
        num_beams=config.num_beams,
        num_return_sequences=config.num_return_sequences,
        length_penalty=config.length_penalty,
    )
    return lambda ids: beam_texts(
        model, tokenizer, ids, settings, config.max_new_tokens, drafter, record
    )


def beam_texts(
    model, tokenizer, ids: list[list[int]], settings, max_new_tokens: int, drafter, record
):
    """Beam search of token prompts ``ids`` (``core.beam.beam_search`` under ``settings``, a
    ``BeamConfig``) as (DecodeStats, each row's best {"text", "tokens", "score"} with its K best
    under "beams"): what the generate command and the service answer."""
    from genrec_spec.core.beam import beam_search

    out = beam_search(
        model,
        ids,
        config=settings,
        max_new_tokens=max_new_tokens,
        eos_token_id=tokenizer.eos_token_id,
        drafter=drafter,
        record=record,
    )
    rows = []
    for sequences, scores in zip(out.tolist(), out.scores.tolist(), strict=True):
        beams = [
            {"text": tokenizer.decode(tokens), "tokens": len(tokens), "score": score}
            for tokens, score in zip(sequences, scores, strict=True)
        ]
        rows.append({**beams[0], "beams": beams})
    return out.stats, rows


def check_beam_settings(num_beams: int, num_return_sequences: int, temperature: float, method: str):
    """Refuse beam search settings that cannot work, before any model runs: the generate
    command's rule and the service's (``method`` a registry name, "none" for plain)."""
    from genrec_spec.core.beam import check_beam_counts
    from genrec_spec.core.types import DecodeInputError

    check_beam_counts(num_beams, num_return_sequences)
    w = num_beams
    if w == 1:
        return
    if temperature != 0:
        raise DecodeInputError(
            f"beam search (num_beams = {w}) with temperature {temperature}",
            "beam search is deterministic: set temperature 0, or num_beams 1 to sample",
        )
    if method not in BEAM_METHODS:
        raise DecodeInputError(
            f"method {method} cannot draft for beam search",
            f"use method {' or '.join(BEAM_METHODS)} with num_beams > 1",
        )


def summary(method: str, batches: list[dict], beams: bool = False) -> dict:
    """Totals over the batches' statistics: tokens, seconds, tokens/s, and the mean accepted
    length (a single path's tokens per row per forward) or, for beam search, its target
    passes (its K sequences share them)."""
    generated = sum(b["generated_tokens"] for b in batches)
    seconds = sum(b["wall_time_s"] for b in batches)
    totals = {
        "method": method,
        "generated_tokens": generated,
        "wall_time_s": seconds,
        "tokens_per_second": generated / max(seconds, 1e-9),
    }
    if beams:
        return totals | {"target_forwards": sum(b["target_forwards"] for b in batches)}
    return totals | {
        "mean_accepted_length": generated / max(sum(b["row_steps"] for b in batches), 1)
    }
