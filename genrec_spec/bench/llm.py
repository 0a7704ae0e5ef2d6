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
candidate generator lowers while drafting; off by default, as it ran at ~0.2x of plain decoding
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

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from torch import Tensor

from genrec_spec.cli.generate import add_tree_arguments
from genrec_spec.core.controller import ControllerConfig, measure_pass_cost
from genrec_spec.core.decode import generate, pack_prompts
from genrec_spec.core.greedy_check import compare_greedy
from genrec_spec.core.types import DecodeStats, SamplingParams
from genrec_spec.llm.methods import (
    CROSS,
    MODEL_FREE,
    PASS_COSTS,
    TRAINED,
    UNTRAINED,
    check_tree_options,
    controller_for,
    load_target,
    make_proposer,
)

# Ours: model-free and draft-model methods, the trained drafters (their weights come from the
# cache: `genrec-spec train-drafter`) and cross-tokenizer drafting (the Gemma-3 target only).
OURS = UNTRAINED
HF = ("hf", "hf-lookup")
# On request: HF's early exit (slow here) and its generate with our trained draft model
# (`train-drafter --kind draft`) as its assistant.
HF_ON_ASK = ("hf-early-exit", "hf-assist")
# HF's universal assisted generation with SmolLM2 drafting, for the Gemma-3 target.
HF_CROSS = ("hf-uag",)
HF_BATCH_1 = ("hf-lookup", "hf-early-exit", "hf-assist", "hf-uag")  # HF's assisted generation
# On request: llama.cpp decoding the shipped GGUF itself (its 4-bit weights, 8-bit activations: not
# the fp32 target, so never exact), through llama-cpp-python, which is not a dependency (it
# compiles llama.cpp on install, ~5-10 minutes). One sequence at a time.
LLAMA_CPP = ("llama-cpp",)
BATCH_1 = HF_BATCH_1 + LLAMA_CPP  # methods timed at batch 1 only
METHODS = OURS + HF  # the default set: runs without trained weights
ALL_METHODS = METHODS + TRAINED + HF_ON_ASK + CROSS + HF_CROSS + LLAMA_CPP
GEMMA3_METHODS = ("none", "cross", "hf", "hf-uag")  # --model gemma3's default set
MODEL_NAMES = {"smollm2": "SmolLM2-135M-Instruct", "gemma3": "Gemma-3-270M"}
# What the Gemma-3 target can run: no native model, so no trained drafter, draft or early exit.
GEMMA3_ALLOWED = MODEL_FREE + HF + CROSS + HF_CROSS


@dataclass(frozen=True)
class BenchLLMConfig:
    """Defaults of ``genrec-spec bench llm`` (the headline run: ~5-8 minutes here)."""

    model: str = "smollm2"  # the target: "smollm2" (native) or "gemma3" (transformers)
    prompts: str = "humaneval"  # "humaneval", "fortunes" or a prompts file
    split: str = "bench"  # prompts held out from drafter training (genrec_spec.llm.prompts)
    n: int = 10
    max_new_tokens: int = 128
    methods: tuple[str, ...] = METHODS  # "none" is always run (the baseline); ALL_METHODS on ask
    batch_sizes: tuple[int, ...] = (1,)
    temperatures: tuple[float, ...] = (0.0,)
    repeats: int = 1  # one pass is ~5-8 minutes at the defaults; raise it for tighter medians
    threads: int = 1  # torch CPU threads: one is fastest for one small model on 2 cores
    seed: int = 0  # prompt draw and sampling
    # Draft depth: None is each method's default (the generate CLI's: 4; quant's deepest chain 16).
    k: int | None = None
    draft_layers: int = 10  # layers of the target the draft method keeps (and HF's early exit)
    hf_lookup_tokens: int = 10  # HF's prompt_lookup_num_tokens
    # The speculation controller's cost model: "measured" times the target's forward over 1-16
    # tokens once before the run (controller.measure_pass_cost; on a CPU 2 tokens cost what 1
    # does and 3 cost 1.4x, far from the linear default); "linear": ControllerConfig's default;
    # "none": no controller, every step drafts the proposer's full tree (what its drafts
    # accept where verification is nearly free, as on a GPU; slower on this CPU).
    pass_cost: str = "measured"
    # EAGLE-2's dynamic tree (eagle2, eagle3): draft nodes kept, children per expanded node and
    # the deepest level; None keeps the proposer's CPU-sized defaults (12, 4 and 6; the EAGLE-2
    # paper's nodes and children are 60 and 10).
    tree_nodes: int | None = None
    tree_top_k: int | None = None
    tree_depth: int | None = None
    warmup_tokens: int = 4  # untimed tokens each method decodes first (first-call costs)
    # --quick: a smoke test of every method, batch size > 1 and sampling in about a minute.
    quick_n: int = 2
    quick_max_new_tokens: int = 8
    quick_batch_sizes: tuple[int, ...] = (1, 2)
    quick_temperatures: tuple[float, ...] = (0.0, 0.8)


@dataclass(frozen=True)
class Run:
    """One method on one prompt batch."""

    outputs: list[list[int]]  # generated tokens per row
    seconds: float
    stats: DecodeStats | None  # None for Hugging Face's generate


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


# --- methods -----------------------------------------------------------------------------------

Runner = Callable[[list[list[int]], SamplingParams, int, int], Run]  # rows, sampling, seed, tokens


def ours(
    model: object, proposer: object, eos: int | None, controller: ControllerConfig | None = None
) -> Runner:
    """Our generate() with a proposer (None: plain decoding) on right-padded prompts."""

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
            generator=torch.Generator().manual_seed(seed),
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
        ids, mask = left_padded(rows, pad)
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
        seconds = time.perf_counter() - start
        generated = out[:, ids.shape[1] :].tolist()
        return Run([_cut_at_eos(row, eos) for row in generated], seconds, None)

    return run


def llama_cpp(threads: int, eos: int | None) -> Runner:
    """llama.cpp (llama-cpp-python) on SmolLM2's shipped GGUF, one prompt at a time; sampled
    runs use the temperature alone (top-k, top-p, min-p and the repeat penalty switched off)."""
    try:
        from llama_cpp import Llama as LlamaCpp
    except ImportError as err:
        raise RuntimeError(
            "method llama-cpp needs llama-cpp-python: `pip install llama-cpp-python` (it compiles "
            "llama.cpp, ~5-10 minutes), or leave llama-cpp out of --methods"
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


def _cut_at_eos(row: list[int], eos: int | None) -> list[int]:
    """HF pads finished rows after their eos; keep tokens up to and including the eos."""
    return row[: row.index(eos) + 1] if eos is not None and eos in row else row


def make_runners(
    model: object,
    hf_model: object | None,
    settings: BenchLLMConfig,
    eos: int | None,
    tokenizer: object = None,
) -> dict[str, Runner]:
    """tokenizer: the target's (cross and hf-uag translate through text)."""
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


# --- the benchmark -----------------------------------------------------------------------------


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
        raise ValueError("methods must include 'none': plain decoding is the baseline")
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


# --- command line ------------------------------------------------------------------------------


def _list(kind: type) -> Callable[[str], tuple]:
    def parse(text: str) -> tuple:
        try:
            return tuple(kind(x) for x in text.split(",") if x.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list") from None

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    c = BenchLLMConfig()
    parser.add_argument(
        "--model",
        choices=("smollm2", "gemma3"),
        default=c.model,
        help="the target: SmolLM2-135M-Instruct, or Gemma-3-270M with cross-tokenizer drafting "
        f"(default methods {','.join(GEMMA3_METHODS)})",
    )
    parser.add_argument(
        "--prompts", default=c.prompts, help="humaneval, fortunes or a prompts file"
    )
    parser.add_argument("--split", default=c.split, choices=["bench", "train", "all"])
    parser.add_argument("--n", type=int, help=f"prompts (default {c.n}; --quick {c.quick_n})")
    parser.add_argument("--max-new-tokens", type=int, help=f"default {c.max_new_tokens}")
    parser.add_argument(
        "--methods",
        type=_list(str),
        default=None,
        help=f"of {','.join(ALL_METHODS)} (default {','.join(c.methods)}; --model gemma3: "
        f"{','.join(GEMMA3_METHODS)})",
    )
    parser.add_argument("--batch-sizes", type=_list(int), help="e.g. 1,8 (default 1)")
    parser.add_argument("--temperatures", type=_list(float), help="e.g. 0,0.8 (default 0)")
    parser.add_argument("--repeats", type=int, default=c.repeats)
    parser.add_argument("--threads", type=int, default=c.threads, help="torch CPU threads")
    parser.add_argument("--seed", type=int, default=c.seed)
    parser.add_argument(
        "--k",
        type=int,
        default=c.k,
        help="draft depth (draft, ngram, trie, distilled, layerskip: default 4; quant: the "
        "deepest chain, default 16)",
    )
    parser.add_argument(
        "--draft-layers",
        type=int,
        default=c.draft_layers,
        help="target layers the draft method keeps and hf-early-exit exits after",
    )
    parser.add_argument(
        "--pass-cost",
        choices=PASS_COSTS,
        default=c.pass_cost,
        help="speculation controller's cost of scoring n tokens: timed once before the run, or "
        "the linear default model; none: no controller, every step drafts the full tree (the "
        "accepted length where verification is nearly free, as on a GPU)",
    )
    add_tree_arguments(parser)
    parser.add_argument("--json", type=Path, help="also write the rows to this JSON file")
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke test: n={c.quick_n}, {c.quick_max_new_tokens} tokens, "
        f"B={c.quick_batch_sizes}, T={c.quick_temperatures} unless given",
    )


def settings_from(args: argparse.Namespace) -> BenchLLMConfig:
    """The run's settings: explicit options, else --quick's, else the defaults."""
    c = BenchLLMConfig()
    q = args.quick

    def pick(value, quick, default):
        return value if value is not None else quick if q else default

    methods = args.methods or (GEMMA3_METHODS if args.model == "gemma3" else c.methods)
    unknown = [m for m in methods if m not in ALL_METHODS]
    allowed = (
        GEMMA3_ALLOWED
        if args.model == "gemma3"
        else tuple(m for m in ALL_METHODS if m not in CROSS + HF_CROSS)
    )
    settings = replace(
        c,
        model=args.model,
        prompts=args.prompts,
        split=args.split,
        n=pick(args.n, c.quick_n, c.n),
        max_new_tokens=pick(args.max_new_tokens, c.quick_max_new_tokens, c.max_new_tokens),
        # plain decoding first: it is every speedup's denominator
        methods=("none",) + tuple(dict.fromkeys(m for m in methods if m != "none")),
        batch_sizes=pick(args.batch_sizes, c.quick_batch_sizes, c.batch_sizes),
        temperatures=pick(args.temperatures, c.quick_temperatures, c.temperatures),
        repeats=args.repeats,
        threads=args.threads,
        seed=args.seed,
        k=args.k,
        draft_layers=args.draft_layers,
        pass_cost=args.pass_cost,
        tree_nodes=args.tree_nodes,
        tree_top_k=args.tree_top_k,
        tree_depth=args.tree_depth,
    )
    if unknown:
        raise ValueError(f"unknown methods {unknown}; choose from {','.join(ALL_METHODS)}")
    check_tree_options(methods, settings.tree_nodes, settings.tree_top_k, settings.tree_depth)
    if any(m not in allowed for m in methods):
        raise ValueError(
            f"--model {args.model} runs only {','.join(allowed)} (cross and hf-uag: --model gemma3)"
        )
    counts = (
        settings.n,
        settings.max_new_tokens,
        settings.repeats,
        settings.threads,
        settings.k or 1,
    )
    if not settings.batch_sizes or min(counts + settings.batch_sizes) < 1:
        raise ValueError("--n, --max-new-tokens, --repeats, --threads, --k, --batch-sizes: >= 1")
    if not settings.temperatures or min(settings.temperatures) < 0:
        raise ValueError("--temperatures: give values >= 0 (0 = greedy)")
    return settings


def run(args: argparse.Namespace) -> int:
    from transformers.utils import logging

    from genrec_spec.llm.prompts import load_prompts
    from genrec_spec.models.llm.smollm2 import smollm2_hf_dir

    settings = settings_from(args)
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
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    rows = benchmark(
        model,
        hf_model,
        prompts,
        settings,
        tokenizer.eos_token_id,
        log=lambda line: print(line, file=sys.stderr, flush=True),
        tokenizer=tokenizer,
    )
    load_after = os.getloadavg()[0]
    lengths = [len(p) for p in prompts]
    print(
        f"{MODEL_NAMES[settings.model]} on cpu, {settings.threads} thread(s): {settings.prompts} "
        f"({settings.split} split) n={len(prompts)}, prompt tokens {min(lengths)}-{max(lengths)}, "
        f"max_new_tokens={settings.max_new_tokens}, median of {settings.repeats} repeat(s); "
        f"{time.perf_counter() - started:.0f} s, load average {load_before:.2f} -> "
        f"{load_after:.2f}"
    )
    print(format_table(rows))
    if args.json:
        report = {
            "settings": asdict(settings),
            "load_average": [load_before, load_after],
            "rows": [asdict(row) for row in rows],
        }
        args.json.write_text(json.dumps(report, indent=1))
    return 0
