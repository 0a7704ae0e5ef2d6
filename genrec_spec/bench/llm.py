"""LLM decoding benchmark: ``genrec-spec bench llm``.

In one process and one run, on the same prompts and the same SmolLM2-135M-Instruct weights, it
times plain decoding (``none``) and every speculative method of the core (``draft``: a
layer-skipped copy of the target, ``ngram``: prompt lookup, ``trie``: multi-branch n-gram trie,
``lookahead``), and what a user would pick instead: Hugging Face ``generate`` on the same
weights, plain (``hf``) and with prompt lookup (``hf-lookup``; batch 1 only, as HF's assisted
generation does not batch), for every batch size and temperature asked for. On request also the
trained drafters (``medusa``, ``eagle``, ``eagle2``, ``eagle3``, ``mtp``: DeepSeek-V3-style
MTP modules, ``layerskip``: the target's first layers plus a trained exit head, ``distilled``:
the draft model of ``train-drafter --kind draft``) and two more HF options, batch 1 only:
early exit (``hf-early-exit``: the target's first ``--draft-layers`` layers and its LM head
draft, ``assistant_early_exit``; Llama supports it,
as its forward runs the first ``config.num_hidden_layers`` layers, which HF's early-exit
candidate generator lowers while drafting; off by default, as it is slower than plain decoding
on SmolLM2) and our distilled draft as ``assistant_model`` (``hf-assist``). HF's assisted
generation keeps its own defaults (up to 20 draft tokens, stopping below 0.4 draft confidence).
Also on request, batch 1 only: ``llama-cpp``, llama.cpp decoding the shipped 4-bit GGUF itself
(needs ``pip install llama-cpp-python``; its output is the 4-bit model's, so never "yes").

Columns:
  tok/s    generated tokens / wall seconds over all prompts (median over repeats)
  speedup  over plain decoding in the same run (ratio of the medians)
  vs-hf    over the fastest Hugging Face option of the same batch size and temperature
  acc-len  tokens emitted per row per target forward (plain decoding: 1.00)
  exact    greedy runs: every row equals plain decoding's output ("yes"), or first differs at
           generated token i where the target's top-2 logits are a tie < 1e-4 ("tie@i"), or
           does not ("no@i": a bug, except for llama-cpp, which decodes another model: the
           4-bit one); "ref" marks plain decoding itself, "-" sampled runs
  accept   acceptance per draft position 1..k: accepted / drafted row-steps

Timing: within each repeat the methods run round-robin one prompt batch at a time, the order
rotating every batch, so drift of this shared machine hits every method alike; each method
first decodes a few tokens untimed (warm-up). Batches of B > 1 hold prompts of uneven lengths
(right-padded with their lengths for ours, left-padded with an attention mask for HF). Prompts
come from the held-out ``bench`` split (``genrec_spec.llm.prompts``). Example (the headline row):

    genrec-spec bench llm --prompts humaneval --n 10 --max-new-tokens 128

``--model gemma3`` benchmarks Gemma-3-270M (a transformers model, 262,144-token vocabulary) as
the target instead: our plain decoding of it (``none``, through ``HFTarget``), cross-tokenizer
drafting by SmolLM2-135M (``cross``), and Hugging Face ``generate`` on the same model object,
plain (``hf``) and with its universal assisted generation (``hf-uag``: SmolLM2 as
``assistant_model`` with both tokenizers; batch 1 only); the model-free methods on request:

    genrec-spec bench llm --model gemma3 --n 6 --max-new-tokens 96
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from genrec_spec.bench.errors import BenchError
from genrec_spec.bench.llm_config import (
    BATCH_1,
    HF,
    HF_CROSS,
    HF_ON_ASK,
    MODEL_NAMES,
    BenchLLMConfig,
)
from genrec_spec.bench.llm_runners import Run, Runner, make_runners
from genrec_spec.core.greedy_check import compare_greedy
from genrec_spec.core.types import SamplingParams
from genrec_spec.machine import describe, describe_device


@dataclass
class Tally:
    """One method's totals over one repeat (all prompt batches)."""

    tokens: int = 0
    seconds: float = 0.0
    row_steps: int = 0
    drafted: list[int] = field(default_factory=list)  # [K] row-steps per draft position
    accepted: list[int] = field(default_factory=list)  # [K]
    outputs: list[list[int]] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)

    def add(self, run: Run) -> None:
        self.tokens += sum(len(row) for row in run.outputs)
        self.seconds += run.seconds
        self.outputs += run.outputs
        if run.stats is not None:
            self.row_steps += run.stats.row_steps
            self.drafted = _add(self.drafted, run.stats.drafted_per_position)
            self.accepted = _add(self.accepted, run.stats.accepted_per_position)


def _add(total: list[int], more: tuple[int, ...]) -> list[int]:
    return [a + b for a, b in zip(total or [0] * len(more), more, strict=True)]


@dataclass(frozen=True)
class Row:
    """One line of the table."""

    method: str
    batch_size: int
    temperature: float
    tokens_per_s: float  # median over repeats
    speedup: float  # over plain decoding (ratio of medians)
    vs_hf: float | None  # over the fastest HF option of this batch size and temperature
    accepted_length: float | None  # None for HF
    exact: str  # "ref", "yes", "tie@i", "no@i" or "-"
    acceptance: tuple[float, ...]  # [K] per draft position
    tokens_per_s_repeats: tuple[float, ...]


def benchmark(
    model: object,
    hf_model: object | None,
    prompts: list[list[int]],
    settings: BenchLLMConfig,
    eos: int | None = None,
    log: Callable[[str], None] = lambda line: None,
    tokenizer: object = None,
) -> list[Row]:
    """Every (batch size, temperature) of settings: every method on the same prompts (token
    ids per prompt), timed round-robin; one Row per method that supports the batch size.

    model: the target (the native Llama for SmolLM2); hf_model: the same weights as a
    transformers model (needed only for the hf methods; Gemma-3 is one already); log: receives
    one progress line per repeat; tokenizer: the target's (needed by cross and hf-uag)."""
    if "none" not in settings.methods:
        raise BenchError(
            f"methods {settings.methods} leave out 'none'",
            "include 'none': plain decoding is the baseline",
        )
    runners = make_runners(model, hf_model, settings, eos, tokenizer)
    rows = []
    for batch_size in settings.batch_sizes:
        batches = [prompts[i : i + batch_size] for i in range(0, len(prompts), batch_size)]
        # HF's assisted generation and llama-cpp run batch 1 only.
        methods = {m: r for m, r in runners.items() if batch_size == 1 or m not in BATCH_1}
        for temperature in settings.temperatures:
            sampling = SamplingParams(temperature)
            tallies = time_methods(methods, batches, sampling, settings)
            for repeat in range(settings.repeats):
                log(
                    f"B={batch_size} T={temperature:g} repeat {repeat + 1}/{settings.repeats}: "
                    + ", ".join(f"{m} {t[repeat].tokens_per_s:.1f}" for m, t in tallies.items())
                    + " tok/s"
                )
            exact = _exactness(model, prompts, tallies) if sampling.greedy else {}
            rows += _rows(tallies, batch_size, temperature, exact)
    return rows


def time_methods(
    runners: dict[str, Runner],
    batches: list[list[list[int]]],
    sampling: SamplingParams,
    settings: BenchLLMConfig,
) -> dict[str, list[Tally]]:
    """Method -> one Tally per repeat. Each method first decodes a few tokens untimed
    (first-call allocations, lazy imports); then, per repeat and prompt batch, every method
    runs once, starting one method later each batch."""
    names = list(runners)
    for name in names:
        runners[name](batches[0], sampling, settings.seed, settings.warmup_tokens)
    tallies = {name: [] for name in names}
    for repeat in range(settings.repeats):
        current = {name: Tally() for name in names}
        for b, batch in enumerate(batches):
            turn = (repeat * len(batches) + b) % len(names)
            seed = settings.seed + 1000 * repeat + b  # the same for every method
            for name in names[turn:] + names[:turn]:
                current[name].add(runners[name](batch, sampling, seed, settings.max_new_tokens))
        for name in names:
            tallies[name].append(current[name])
    return tallies


def _exactness(
    model: object, prompts: list[list[int]], tallies: dict[str, list[Tally]]
) -> dict[str, str]:
    """Greedy runs: each method's outputs (every repeat) against plain decoding's; the
    verdict of a method is its first "no@i", else its first "tie@i", else "yes"."""
    verdicts = {"none": "ref"}
    for method, repeats in tallies.items():
        if method == "none":
            continue
        rows = []
        for tally, plain in zip(repeats, tallies["none"], strict=True):
            rows += compare_greedy(model, prompts, plain.outputs, tally.outputs)
        no = [v for v in rows if v.startswith("no@")]
        ties = [v for v in rows if v.startswith("tie@")]
        verdicts[method] = (no or ties or ["yes"])[0]
    return verdicts


def _rows(
    tallies: dict[str, list[Tally]], batch_size: int, temperature: float, exact: dict[str, str]
) -> list[Row]:
    speed = {m: [t.tokens_per_s for t in ts] for m, ts in tallies.items()}
    median = {m: statistics.median(s) for m, s in speed.items()}
    hf_best = max((median[m] for m in median if m in HF + HF_ON_ASK + HF_CROSS), default=None)
    rows = []
    for method, repeats in tallies.items():
        # Acceptance counts summed over every repeat.
        tokens, steps = sum(t.tokens for t in repeats), sum(t.row_steps for t in repeats)
        drafted = [sum(column) for column in zip(*(t.drafted for t in repeats), strict=True)]
        accepted = [sum(column) for column in zip(*(t.accepted for t in repeats), strict=True)]
        rows.append(
            Row(
                method=method,
                batch_size=batch_size,
                temperature=temperature,
                tokens_per_s=median[method],
                speedup=median[method] / median["none"],
                vs_hf=None if hf_best is None else median[method] / hf_best,
                accepted_length=tokens / steps if steps else None,
                exact=exact.get(method, "-"),
                acceptance=tuple(a / max(d, 1) for a, d in zip(accepted, drafted, strict=True)),
                tokens_per_s_repeats=tuple(speed[method]),
            )
        )
    return rows


def format_table(rows: list[Row]) -> str:
    width = max([len("method")] + [len(r.method) for r in rows])
    lines = [
        f"{'method':<{width}} {'B':>2} {'T':>4} {'tok/s':>7} {'speedup':>8} {'vs-hf':>6} "
        f"{'acc-len':>7} {'exact':>7}  accept per draft position"
    ]
    for r in rows:
        vs_hf = "-" if r.vs_hf is None else f"{r.vs_hf:.2f}x"
        length = "-" if r.accepted_length is None else f"{r.accepted_length:.2f}"
        accept = " ".join(f"{a:.2f}" for a in r.acceptance) or "-"
        lines.append(
            f"{r.method:<{width}} {r.batch_size:>2} {r.temperature:>4g} {r.tokens_per_s:>7.2f} "
            f"{r.speedup:>7.2f}x {vs_hf:>6} {length:>7} {r.exact:>7}  {accept}"
        )
    return "\n".join(lines)


@dataclass(frozen=True)
class Report:
    """What a run of the benchmark found, and under which conditions."""

    header: str  # the model, machine load, prompts and settings in one line
    machine: list[str]  # the CPU, its flags and threads; the CPU paths chosen for this run
    settings: BenchLLMConfig
    load_average: tuple[float, float]  # the 1-minute load average before and after
    rows: list[Row]

    def as_json(self) -> dict:
        return {
            "settings": asdict(self.settings),
            "machine": self.machine,
            "load_average": list(self.load_average),
            "rows": [asdict(row) for row in self.rows],
        }


def bench_llm(settings: BenchLLMConfig, log: Callable[[str], None] = lambda line: None) -> Report:
    """Load the target (and, for the hf methods, the same weights in transformers), draw the
    prompts and run the benchmark; ``log`` receives one progress line per repeat."""
    from transformers.utils import logging

    from genrec_spec.llm.methods import load_target
    from genrec_spec.llm.prompts import load_prompts
    from genrec_spec.models.llm.smollm2 import smollm2_hf_dir

    torch.set_num_threads(settings.threads)
    logging.set_verbosity_error()  # generate's notes on generation flags
    model, tokenizer = load_target(settings.model)
    # A base model (Gemma-3-270M) has no chat template: chat sources come as plain text.
    chat = None if getattr(tokenizer, "chat_template", None) else False
    texts = load_prompts(
        settings.prompts, settings.n, settings.seed, settings.split, tokenizer, chat=chat
    )
    prompts = [tokenizer(text)["input_ids"] for text in texts]
    hf_model = model if settings.model == "gemma3" else None  # Gemma-3 is a transformers model
    if hf_model is None and any(m in HF + HF_ON_ASK for m in settings.methods):
        from transformers import AutoModelForCausalLM

        hf_model = AutoModelForCausalLM.from_pretrained(smollm2_hf_dir(), dtype=torch.float32)
        hf_model.eval()
    model = model.to(settings.device)
    hf_model = None if hf_model is None else hf_model.to(settings.device)
    if settings.device == "cpu":
        machine = cpu_paths(model, settings.methods)  # measured now, not in the timed runs
    else:
        machine = [f"machine: {describe_device(settings.device)}"]
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    eos = tokenizer.eos_token_id
    rows = benchmark(model, hf_model, prompts, settings, eos, log=log, tokenizer=tokenizer)
    load_after = os.getloadavg()[0]
    lengths = [len(p) for p in prompts]
    header = (
        f"{MODEL_NAMES[settings.model]} on {settings.device}, {settings.threads} thread(s): "
        f"{settings.prompts} "
        f"({settings.split} split) n={len(prompts)}, prompt tokens {min(lengths)}-{max(lengths)}, "
        f"max_new_tokens={settings.max_new_tokens}, median of {settings.repeats} repeat(s); "
        f"{time.perf_counter() - started:.0f} s, load average {load_before:.2f} -> "
        f"{load_after:.2f}"
    )
    return Report(header, machine, settings, (load_before, load_after), rows)


def cpu_paths(model: object, methods: tuple[str, ...]) -> list[str]:
    """The machine and the CPU paths our methods take on it, one line each: the linear path per
    shape and row count of a native target (chosen now, `cpu_linear.measure_shapes`, so the
    timed runs do not measure) and the 4-bit op's loop where ``quant`` runs."""
    from genrec_spec.models.llm import cpu_linear
    from genrec_spec.models.llm.llama import Llama

    lines = [f"machine: {describe()}"]
    if isinstance(model, Llama):
        cpu_linear.measure_shapes(model.linear_shapes())
        lines += cpu_linear.summary(model.linear_shapes())
    if "quant" in methods:
        from genrec_spec.kernels.q4 import path

        lines.append(f"quant draft: the 4-bit op's {path()} loop")
    return lines
