"""Texts for a list of prompts, decoded plainly or with a speculative method of the registry
(`genrec_spec.llm.methods`), with the decoding statistics: what `genrec-spec generate` runs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from genrec_spec.llm import methods


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


def generate_texts(prompts: list[str], config: GenerationConfig) -> dict:
    """Decode every prompt, ``config.batch_size`` at a time: ``{"results": [{"prompt", "text",
    "tokens"}], "batches": [DecodeStats.as_dict()], "summary": {...}}``. Bad settings are
    refused before any model is loaded."""
    import torch

    from genrec_spec.core.controller import cached_pass_cost
    from genrec_spec.core.decode import generate
    from genrec_spec.core.types import DecodeInputError, SamplingParams
    from genrec_spec.llm.threads import fastest_threads

    if config.batch_size < 1:
        raise DecodeInputError(f"--batch-size {config.batch_size}", "use --batch-size >= 1")
    sampling = SamplingParams(config.temperature, config.top_k, config.top_p)
    methods.check_method(config.model, config.method)
    tree = (config.tree_nodes, config.tree_top_k, config.tree_depth)
    methods.check_tree_options((config.method,), *tree)
    if config.threads < 0:
        raise DecodeInputError(
            f"--threads {config.threads}", "use --threads >= 1, or 0 to measure the fastest"
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
    proposer = methods.make_proposer(
        config.method,
        model,
        config.k,
        config.draft_layers,
        config.drafter,
        config.model,
        tokenizer,
        *tree,
    )
    controller = None  # plain decoding: nothing to control (and no pass cost to time)
    if proposer is not None:
        controller = methods.controller_for(config.pass_cost, lambda: cached_pass_cost(model))
    generator = torch.Generator().manual_seed(config.seed)
    results, batches = [], []
    for start in range(0, len(prompts), config.batch_size):
        chunk = prompts[start : start + config.batch_size]
        out = generate(
            model,
            [tokenizer(p)["input_ids"] for p in chunk],
            proposer=proposer,
            sampling=sampling,
            max_new_tokens=config.max_new_tokens,
            generator=generator,
            eos_token_id=tokenizer.eos_token_id,
            controller=controller,
        )
        batches.append(out.stats.as_dict())
        for prompt, tokens in zip(chunk, out.tolist(), strict=True):
            results.append(
                {"prompt": prompt, "text": tokenizer.decode(tokens), "tokens": len(tokens)}
            )
    return {"results": results, "batches": batches, "summary": summary(config.method, batches)}


def summary(method: str, batches: list[dict]) -> dict:
    """Totals over the batches' statistics: tokens, seconds, tokens/s, mean accepted length."""
    generated = sum(b["generated_tokens"] for b in batches)
    seconds = sum(b["wall_time_s"] for b in batches)
    return {
        "method": method,
        "generated_tokens": generated,
        "wall_time_s": seconds,
        "tokens_per_second": generated / max(seconds, 1e-9),
        "mean_accepted_length": generated / max(sum(b["row_steps"] for b in batches), 1),
    }
