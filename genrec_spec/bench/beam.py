"""Beam search benchmark: ``genrec-spec bench beam``.

In one process, on the same SmolLM2-135M-Instruct weights, prompts and thread count, it times
transformers' ``generate(num_beams=W, num_return_sequences=K)`` (``hf``) against the core's
beam search: plain (``beam``) and speculative (``spec``) on the native Llama, and the same two
through ``HFTarget`` on transformers' own model object (``hft-beam``, ``hft-spec``).

Tasks:
  titles  catalogue-grounded recommendation: ML-1M test users, the prompt lists each user's
          recent titles (``llm.title_recommender``), every method decodes under the catalogue
          of 3,706 titles (``prefix_allowed_tokens_fn`` for transformers, a ``Catalogue`` for
          ours; ``spec`` drafts the titles' forced continuations)
  code    unconstrained beam search continuing HumanEval prompts (``--max-new-tokens``);
          ``spec`` drafts below every beam what followed its last tokens earlier in its text
          (prompt lookup: ``core.prompt_lookup.PromptLookupDrafter``)

Columns:
  ms/req   wall milliseconds per request (user or prompt): the median over repeats of the
           whole workload's time, divided by its requests; batches of B run one after another
  passes   target forwards per request (transformers: one per generated token, plus prefill)
  nodes    tree nodes scored per forward of ours
  vs-hf    transformers' ms/req over this row's, same W and B
  vs-beam  our plain beam's ms/req over this row's, same target
  exact    requests whose K results (tokens and order) equal transformers' (or, without hf,
           our plain beam's): "n/N"; a difference is either a float tie or a bug

Timing: the methods take turns (``machine.time_in_turns``), after one untimed warm-up round.
Example (the headline row): ``genrec-spec bench beam --beam-widths 10 --batch-sizes 1``; on a
GPU, ``--device cuda`` (both models there; a search's tables live beside its target's outputs).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from genrec_spec.bench.errors import BenchError
from genrec_spec.bench.llm_runners import cut_at_eos, left_padded
from genrec_spec.core.beam import BeamConfig, beam_search
from genrec_spec.core.catalogue_drafter import CatalogueDrafter
from genrec_spec.core.prompt_lookup import PromptLookupDrafter
from genrec_spec.core.targets import HFTarget
from genrec_spec.llm.methods import PASS_COSTS, draft_record
from genrec_spec.llm.title_recommender import TitleRecommender, item_titles
from genrec_spec.machine import describe_device, time_in_turns

METHODS = ("hf", "beam", "spec", "hft-beam", "hft-spec")
TASKS = ("titles", "code")


@dataclass(frozen=True)
class BenchBeamConfig:
    """Defaults of ``genrec-spec bench beam``."""

    task: str = "titles"
    methods: tuple[str, ...] = METHODS
    beam_widths: tuple[int, ...] = (10,)  # W
    k: int = 10  # results per request (at most W)
    batch_sizes: tuple[int, ...] = (1,)
    requests: int = 8  # users (titles) or prompts (code) per setting
    repeats: int = 3
    threads: int = 1
    max_new_tokens: int = 32  # code task (titles: the longest title)
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    draft_depth: int = CatalogueDrafter.depth  # spec: levels drafted below each beam per pass
    draft_fanout: int = CatalogueDrafter.fanout  # spec: children of nodes with at most this many
    draft_items: int = CatalogueDrafter.items  # spec: ... or at most this many items below
    draft_nodes: int = BeamConfig.draft_nodes  # spec: drafted nodes per pass, all rows
    lookup_depth: int = PromptLookupDrafter.depth  # spec, code task: tokens drafted a beam
    # spec: how a search prices drafted nodes when deciding from the run's earlier searches
    # whether to draft (core.draft_record; llm.methods.controller_for)
    pass_cost: str = "measured"
    seed: int = 0
    device: str = "cpu"  # where both models run: "cuda" for a GPU

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise BenchError(f"unknown task {self.task!r}", f"choose one of {', '.join(TASKS)}")
        if self.pass_cost not in PASS_COSTS:
            raise BenchError(
                f"unknown pass cost {self.pass_cost!r}", f"choose one of {', '.join(PASS_COSTS)}"
            )
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown:
            raise BenchError(f"unknown methods {unknown}", f"choose from {','.join(METHODS)}")
        try:
            device = torch.device(self.device)
        except RuntimeError as error:
            raise BenchError(f"unknown device {self.device!r}", "pass cpu, or cuda") from error
        if device.type == "cuda" and not torch.cuda.is_available():
            raise BenchError(
                f"--device {self.device}: torch finds no CUDA GPU on this machine",
                "run it where one is (and a CUDA build of torch), or pass --device cpu",
            )
        counts = (self.k, self.requests, self.repeats, self.threads, self.max_new_tokens)
        if min(counts + self.beam_widths + self.batch_sizes) < 1:
            raise BenchError(
                "--k, --requests, --repeats, --threads, --max-new-tokens, --beam-widths and "
                "--batch-sizes must all be >= 1",
                "pass positive values",
            )


@dataclass(frozen=True)
class Row:
    method: str
    beams: int
    batch: int
    ms_per_request: float
    passes_per_request: float
    nodes_per_pass: float
    vs_hf: float | None
    vs_beam: float | None
    exact: str


@dataclass(frozen=True)
class Workload:
    """The requests of one task: prompts, the constraint for ours, transformers' hook."""

    prompts: list[list[int]]
    catalogue: object | None  # a Catalogue for the titles task
    allowed: Callable[[int], Callable] | None  # padded prompt width -> prefix_allowed_tokens_fn
    max_new_tokens: int
    eos: int


def title_workload(tokenizer, requests: int, seed: int) -> Workload:
    """ML-1M test users (a seeded sample) and the catalogue of every title."""
    from genrec_spec.data_pipelines.loaders import load_dataset
    from genrec_spec.data_pipelines.split import build_item_index, leave_one_out, user_sequences

    raw = load_dataset("ml-1m")
    test = leave_one_out(user_sequences(raw.interactions, build_item_index(raw.items))).test
    recommender = TitleRecommender(None, tokenizer, item_titles(raw.items))
    users = torch.randperm(len(test.targets), generator=torch.Generator().manual_seed(seed))
    prompts = [
        recommender.prompt(test.values[test.offsets[u] : test.offsets[u + 1]].tolist())
        for u in users[:requests].tolist()
    ]
    catalogue = recommender.catalogue
    allowed = hf_allowed_tokens(catalogue, recommender.eos)
    return Workload(prompts, catalogue, allowed, catalogue.trie.longest, recommender.eos)


def hf_allowed_tokens(catalogue, eos: int) -> Callable[[int], Callable]:
    """A ``prefix_allowed_tokens_fn`` over the catalogue for transformers' generate, for
    prompts left-padded to ``width``: the generated part's trie node, walked from its parent's
    (a dict per prefix, as a user would write it)."""
    trie = catalogue.trie
    offsets, tokens = trie.child_offsets.tolist(), trie.child_tokens.tolist()
    allowed: dict[tuple[int, ...], list[int]] = {}
    walk = [((), 0)]  # (prefix, its trie node) still to list
    while walk:
        prefix, node = walk.pop()
        edges = range(offsets[node], offsets[node + 1])
        allowed[prefix] = [tokens[e] for e in edges]
        walk.extend(((*prefix, tokens[e]), e + 1) for e in edges)  # edge e leads to node e + 1

    def make(width: int) -> Callable:
        def fn(batch_id: int, input_ids: torch.Tensor) -> list[int]:
            # A finished title may only repeat its end token (transformers refuses an empty
            # list; it extends finished beams when too few others remain).
            return allowed.get(tuple(input_ids[width:].tolist())) or [eos]

        return fn

    return make


def code_workload(tokenizer, requests: int, seed: int, max_new_tokens: int) -> Workload:
    from genrec_spec.llm.prompts import load_prompts

    texts = load_prompts("humaneval", requests, seed)
    prompts = [tokenizer(text)["input_ids"] for text in texts]
    return Workload(prompts, None, None, max_new_tokens, int(tokenizer.eos_token_id))


def runners(
    methods: Sequence[str], native, hf_model, work: Workload, config: BenchBeamConfig, w: int
) -> dict[str, Callable[[list[list[int]]], tuple[list, object]]]:
    """method -> (a batch of prompts -> (K token lists per prompt, stats or None))."""
    settings = BeamConfig(
        num_beams=w,
        num_return_sequences=min(config.k, w),
        length_penalty=config.length_penalty,
        early_stopping=config.early_stopping,
        draft_nodes=config.draft_nodes,
    )
    if work.catalogue is not None:
        drafter = CatalogueDrafter(
            work.catalogue, config.draft_depth, config.draft_fanout, items=config.draft_items
        )
    else:  # what followed each beam's last tokens earlier in its text
        drafter = PromptLookupDrafter(depth=config.lookup_depth)

    def ours(model, priced_by=None):
        """Our beam search on `model`; speculative when `priced_by` (the torch module whose pass
        cost prices drafted nodes) is given. A speculative method's searches share one record:
        whether a search drafts is decided from what drafting earned in the earlier ones (the
        warm-up round's too)."""
        spec = priced_by is not None
        record = draft_record(priced_by, config.pass_cost) if spec else None

        def run(batch):
            out = beam_search(
                model,
                batch,
                config=settings,
                max_new_tokens=work.max_new_tokens,
                eos_token_id=work.eos,
                constraint=work.catalogue,
                drafter=drafter if spec else None,
                record=record,
            )
            return out.tolist(), out.stats

        return run

    def hf(batch):
        ids, mask = (t.to(hf_model.device) for t in left_padded(batch, work.eos))
        width = ids.shape[1]
        with torch.inference_mode():
            out = hf_model.generate(
                ids,
                attention_mask=mask,
                num_beams=w,
                num_return_sequences=settings.num_return_sequences,
                length_penalty=settings.length_penalty,
                early_stopping=settings.early_stopping,
                max_new_tokens=work.max_new_tokens,
                eos_token_id=work.eos,
                pad_token_id=work.eos,
                do_sample=False,
                prefix_allowed_tokens_fn=None if work.allowed is None else work.allowed(width),
            )
        k = settings.num_return_sequences
        rows = [cut_at_eos(r, work.eos) for r in out[:, width:].tolist()]
        return [rows[b * k : (b + 1) * k] for b in range(len(batch))], None

    made = {
        "hf": lambda: hf,
        "beam": lambda: ours(native),
        "spec": lambda: ours(native, native),
        "hft-beam": lambda: ours(HFTarget(hf_model)),
        "hft-spec": lambda: ours(HFTarget(hf_model), hf_model),
    }
    return {m: made[m]() for m in methods}


def benchmark(
    native, hf_model, work: Workload, config: BenchBeamConfig, log: Callable[[str], None]
) -> list[Row]:
    rows = []
    for w in config.beam_widths:
        for b in config.batch_sizes:
            runs = runners(config.methods, native, hf_model, work, config, w)
            batches = [work.prompts[i : i + b] for i in range(0, len(work.prompts), b)]
            results: dict[str, tuple[list, list]] = {}
            calls = {name: _workload(run, name, batches, results) for name, run in runs.items()}
            seconds = time_in_turns(calls, config.repeats)
            rows += _rows(results, seconds, len(work.prompts), w, b)
            log(f"W={w} B={b}: " + ", ".join(f"{m} {s:.1f} s" for m, s in seconds.items()))
    return rows


def _workload(run, name: str, batches: list, results: dict) -> Callable[[], None]:
    """Run every batch; keep the outputs and stats in results[name]."""

    def call():
        outs = [run(batch) for batch in batches]
        results[name] = ([r for o, _ in outs for r in o], [s for _, s in outs])

    return call


def _rows(results: dict, seconds: dict, requests: int, w: int, b: int) -> list[Row]:
    reference = results.get("hf", results.get("beam"))[0]
    out = []
    for name, (outputs, stats) in results.items():
        base = "beam" if name in ("beam", "spec") else "hft-beam"
        passes = sum(s.target_forwards for s in stats) if stats[0] is not None else None
        nodes = sum(s.nodes_scored for s in stats) if stats[0] is not None else 0
        same = sum(a == r for a, r in zip(outputs, reference, strict=True))
        out.append(
            Row(
                method=name,
                beams=w,
                batch=b,
                ms_per_request=1000 * seconds[name] / requests,
                passes_per_request=(passes or 0) / requests,
                nodes_per_pass=nodes / passes if passes else 0.0,
                vs_hf=seconds["hf"] / seconds[name] if "hf" in seconds else None,
                vs_beam=seconds[base] / seconds[name] if base in seconds and stats[0] else None,
                exact=f"{same}/{requests}",
            )
        )
    return out


def format_table(rows: list[Row]) -> str:
    head = f"{'method':<9} {'W':>3} {'B':>3} {'ms/req':>9} {'passes':>7} {'nodes':>6} "
    head += f"{'vs-hf':>6} {'vs-beam':>7} {'exact':>7}"
    lines = [head]
    for r in rows:
        ratio = lambda x: f"{x:.2f}x" if x is not None else "-"  # noqa: E731
        passes = f"{r.passes_per_request:.1f}" if r.nodes_per_pass else "-"
        nodes = f"{r.nodes_per_pass:.1f}" if r.nodes_per_pass else "-"
        lines.append(
            f"{r.method:<9} {r.beams:>3} {r.batch:>3} {r.ms_per_request:>9.0f} {passes:>7} "
            f"{nodes:>6} {ratio(r.vs_hf):>6} {ratio(r.vs_beam):>7} {r.exact:>7}"
        )
    return "\n".join(lines)


def bench_beam(config: BenchBeamConfig, log: Callable[[str], None] = print) -> str:
    """Load SmolLM2 (native and transformers), build the task and run; returns the report."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    from genrec_spec.bench.llm import cpu_paths
    from genrec_spec.models.llm.smollm2 import load_smollm2, smollm2_hf_dir

    torch.set_num_threads(config.threads)
    logging.set_verbosity_error()
    native, tokenizer = load_smollm2()
    hf_model = AutoModelForCausalLM.from_pretrained(smollm2_hf_dir(), dtype=torch.float32).eval()
    if config.task == "titles":
        work = title_workload(tokenizer, config.requests, config.seed)
    else:
        work = code_workload(tokenizer, config.requests, config.seed, config.max_new_tokens)
    native, hf_model = native.to(config.device), hf_model.to(config.device)
    machine = (
        cpu_paths(native, ())
        if config.device == "cpu"
        else [f"machine: {describe_device(config.device)}"]
    )
    load_before, started = os.getloadavg()[0], time.perf_counter()
    rows = benchmark(native, hf_model, work, config, log)
    lengths = [len(p) for p in work.prompts]
    header = (
        f"SmolLM2-135M-Instruct on {config.device}, {config.threads} thread(s): "
        f"task {config.task}, {len(lengths)} requests, prompt tokens "
        f"{min(lengths)}-{max(lengths)}, K={config.k}, "
        f"max_new_tokens={work.max_new_tokens}, median of {config.repeats} repeat(s); "
        f"{time.perf_counter() - started:.0f} s, load average {load_before:.2f} -> "
        f"{os.getloadavg()[0]:.2f}"
    )
    return "\n".join([header, *machine, format_table(rows)])
