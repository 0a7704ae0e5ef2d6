"""How `genrec-spec bench llm` runs each method on one prompt batch: ours (the core's
``generate`` with a proposer of the registry) and the references (Hugging Face ``generate``,
plain or with its assisted-generation options, and llama.cpp on the shipped GGUF).

A runner takes (rows of prompt token ids, sampling, seed, new tokens) and returns a ``Run``.
Ours takes right-padded prompts with their lengths, Hugging Face left-padded prompts with an
attention mask."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from genrec_spec.bench.errors import BenchError
from genrec_spec.bench.llm_config import CROSS, LLAMA_CPP, OURS, TRAINED, BenchLLMConfig
from genrec_spec.core.controller import ControllerConfig, measure_pass_cost
from genrec_spec.core.decode import generate, pack_prompts
from genrec_spec.core.types import DecodeStats, SamplingParams
from genrec_spec.llm.methods import controller_for, make_proposer
from genrec_spec.machine import finish


@dataclass(frozen=True)
class Run:
    """One method on one prompt batch."""

    outputs: list[list[int]]  # generated tokens per row
    seconds: float
    stats: DecodeStats | None  # None for Hugging Face's generate


Runner = Callable[[list[list[int]], SamplingParams, int, int], Run]  # rows, sampling, seed, tokens


def make_runners(
    model: object,
    hf_model: object | None,
    settings: BenchLLMConfig,
    eos: int | None,
    tokenizer: object = None,
) -> dict[str, Runner]:
    """A runner per method of ``settings``. tokenizer: the target's (cross and hf-uag translate
    through text)."""
    controller = controller_for(settings.pass_cost, lambda: measure_pass_cost(model))
    runners = {}
    for method in settings.methods:
        if method in OURS + TRAINED + CROSS:
            proposer = make_proposer(
                method,
                model,
                settings.k,
                settings.draft_layers,
                model_name=settings.model,
                target_tokenizer=tokenizer,
                tree_nodes=settings.tree_nodes,
                tree_top_k=settings.tree_top_k,
                tree_depth=settings.tree_depth,
            )
            runners[method] = ours(model, proposer, eos, controller)
        elif method in LLAMA_CPP:
            runners[method] = llama_cpp(settings.threads, eos)
        else:
            assistance = hf_assistance(method, model, settings, tokenizer)
            runners[method] = hugging_face(hf_model, eos, assistance)
    return runners


def ours(
    model: object, proposer: object, eos: int | None, controller: ControllerConfig | None = None
) -> Runner:
    """Our generate() with a proposer (None: plain decoding) on right-padded prompts."""

    device = next(model.parameters()).device  # sampling draws where the logits are

    def run(rows: list[list[int]], sampling: SamplingParams, seed: int, new: int) -> Run:
        tokens, lengths = pack_prompts(rows)  # [B, T] right-padded, [B]
        start = time.perf_counter()
        out = generate(
            model,
            tokens,
            prompt_lengths=lengths,
            proposer=proposer,
            sampling=sampling,
            max_new_tokens=new,
            generator=torch.Generator(device).manual_seed(seed),
            eos_token_id=eos,
            controller=controller,
        )
        return Run(out.tolist(), time.perf_counter() - start, out.stats)

    return run


def hugging_face(hf_model: object, eos: int | None, assistance: dict) -> Runner:
    """transformers' generate on left-padded prompts, with ``assistance``: generate's options of
    assisted generation (``hf_assistance``), none for plain decoding."""
    pad = 0 if eos is None else eos

    def run(rows: list[list[int]], sampling: SamplingParams, seed: int, new: int) -> Run:
        ids, mask = (t.to(hf_model.device) for t in left_padded(rows, pad))
        options = {"do_sample": False}
        if not sampling.greedy:  # top_k=0: HF's default of 50 would change the distribution
            options = {"do_sample": True, "temperature": sampling.temperature, "top_k": 0}
        options.update(assistance)
        torch.manual_seed(seed)  # HF samples from the global generator
        start = time.perf_counter()
        with torch.inference_mode():
            out = hf_model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new,
                eos_token_id=eos,
                pad_token_id=pad,
                **options,
            )
        finish(out.device)
        seconds = time.perf_counter() - start
        generated = out[:, ids.shape[1] :].tolist()
        return Run([cut_at_eos(row, eos) for row in generated], seconds, None)

    return run


def llama_cpp(threads: int, eos: int | None) -> Runner:
    """llama.cpp (llama-cpp-python) on SmolLM2's shipped GGUF, one prompt at a time; sampled
    runs use the temperature alone (top-k, top-p, min-p and the repeat penalty switched off)."""
    try:
        from llama_cpp import Llama as LlamaCpp
    except ImportError as err:
        raise BenchError(
            "method llama-cpp needs llama-cpp-python, which is not installed",
            "`pip install llama-cpp-python` (it compiles llama.cpp), or leave llama-cpp out of "
            "--methods",
        ) from err
    from genrec_spec.models.llm.smollm2 import smollm2_gguf_path

    llm = LlamaCpp(
        model_path=str(smollm2_gguf_path()),
        n_threads=threads,
        n_threads_batch=threads,
        n_ctx=4096,
        verbose=False,
    )

    def run(rows: list[list[int]], sampling: SamplingParams, seed: int, new: int) -> Run:
        (row,) = rows  # batch 1
        llm.set_seed(seed)
        options = dict(top_p=1.0, min_p=0.0, typical_p=1.0, repeat_penalty=1.0)
        options |= {"temp": 0.0} if sampling.greedy else {"temp": sampling.temperature, "top_k": 0}
        start = time.perf_counter()
        out = []
        for token in llm.generate(row, reset=True, **options):
            out.append(token)
            if token == eos or len(out) == new:
                break
        return Run([out], time.perf_counter() - start, None)

    return run


def left_padded(rows: list[list[int]], pad: int) -> tuple[Tensor, Tensor]:
    """Prompts left-padded with pad: ids [B, T] and attention mask [B, T] (1 = real token)."""
    width = max(len(row) for row in rows)
    ids = torch.tensor([[pad] * (width - len(row)) + row for row in rows])
    mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in rows])
    return ids, mask


def cut_at_eos(row: list[int], eos: int | None) -> list[int]:
    """HF pads finished rows after their eos; keep tokens up to and including the eos."""
    return row[: row.index(eos) + 1] if eos is not None and eos in row else row


def hf_assistance(
    method: str, model: object, settings: BenchLLMConfig, tokenizer: object = None
) -> dict:
    """generate's options for a Hugging Face method: prompt lookup, early exit (the target's
    own first draft_layers layers draft, as in our draft method), our trained draft model as
    the assistant (a transformers model sharing its weights), or SmolLM2 as the assistant of
    another tokenizer's target (universal assisted generation: ``tokenizer`` is the target's);
    none for plain ``hf``."""
    if method == "hf-uag":
        from transformers import AutoModelForCausalLM

        from genrec_spec.models.llm.smollm2 import load_smollm2_tokenizer, smollm2_hf_dir

        assistant = AutoModelForCausalLM.from_pretrained(smollm2_hf_dir(), dtype=torch.float32)
        return {
            "assistant_model": assistant.eval(),
            "tokenizer": tokenizer,
            "assistant_tokenizer": load_smollm2_tokenizer(),
        }
    if method == "hf-lookup":
        return {"prompt_lookup_num_tokens": settings.hf_lookup_tokens}
    if method == "hf-early-exit":
        return {"assistant_early_exit": settings.draft_layers}
    if method == "hf-assist":
        from genrec_spec.llm.training.checkpoint import default_folder, drafter_kind
        from genrec_spec.llm.training.distill import load_distilled
        from genrec_spec.models.llm.llama_loading import to_hf

        draft, _ = load_distilled(default_folder(drafter_kind("distilled")), model)
        return {"assistant_model": to_hf(draft)}
    return {}
