"""How many torch threads decode a model fastest on this CPU, chosen by measuring it.

One thread was fastest for SmolLM2 on the 2-core machines this project was built on (a small
model's products are too short for a second thread to pay for handing it half), which says
nothing of a server with 16 cores, a larger model or a larger batch. `fastest_threads` times one
decoding step (a one-token pass per row after a short prompt) at 1, 2, 4, ... threads up to the
cores, the counts taking turns so a slow spell of a shared machine lands on each alike, and keeps
the fastest per CPU, torch build, model shape and batch size under
``$GENREC_SPEC_CACHE/threads/``.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from pathlib import Path

import torch

from genrec_spec.cache import cache_dir
from genrec_spec.core.targets import as_target
from genrec_spec.core.types import DraftTree
from genrec_spec.machine import cpu_flags, cpu_model, describe

CONTEXT = 64  # prompt tokens before the timed steps
REPEATS = 5  # timed steps per thread count (median), after one round of warm-up


def candidate_counts(cores: int | None = None) -> tuple[int, ...]:
    """The thread counts timed: powers of two up to the cores, and the cores themselves."""
    cores = cores or os.cpu_count() or 1
    counts = [1]
    while counts[-1] * 2 <= cores:
        counts.append(counts[-1] * 2)
    return tuple(counts) if counts[-1] == cores else (*counts, cores)


def fastest_threads(model: torch.nn.Module, batch_size: int = 1, folder: Path | None = None) -> int:
    """The thread count at which ``model`` (the native Llama or a transformers causal LM)
    decodes a step of ``batch_size`` rows fastest here: timed once (a few seconds), then read
    from ``folder`` (default ``$GENREC_SPEC_CACHE/threads``). A file that cannot be read is timed
    again and replaced."""
    counts = candidate_counts()
    if len(counts) == 1:
        return 1
    folder = cache_dir() / "threads" if folder is None else Path(folder)
    file = folder / f"{_key(model, batch_size, counts)}.json"
    try:
        threads = int(json.loads(file.read_text())["threads"])
        if threads in counts:
            return threads
    except (OSError, ValueError, KeyError, TypeError):
        pass  # absent or unreadable: measure
    seconds = time_threads(model, batch_size, counts)
    threads = min(seconds, key=seconds.get)
    file.parent.mkdir(parents=True, exist_ok=True)
    partial = file.with_name(f"{file.name}.{os.getpid()}.tmp")  # complete files only
    record = {"threads": threads, "step_ms": {c: s * 1e3 for c, s in seconds.items()}}
    partial.write_text(json.dumps(record | {"machine": describe()}, indent=1))
    partial.replace(file)
    return threads


@torch.no_grad()
def time_threads(
    model: torch.nn.Module, batch_size: int, counts: tuple[int, ...]
) -> dict[int, float]:  # thread count -> seconds per decoding step (median)
    """A one-token step per row after a ``CONTEXT``-token prompt, timed at each count in turn;
    the torch thread count is restored after."""
    target = as_target(model)
    rounds = REPEATS + 1
    grown = rounds * len(counts)  # each step keeps its token
    context = min(CONTEXT, target.max_length - 1 - grown)  # a short model keeps a shorter one
    prompt = torch.ones(batch_size, context + 1, dtype=torch.long)  # content: same time
    lengths = torch.full((batch_size,), context + 1)
    cache = target.prefill(prompt, lengths, context + 1 + grown)
    root = DraftTree(torch.ones(batch_size, 1, dtype=torch.long), torch.full((batch_size, 1), -1))
    keep, one = torch.zeros(batch_size, 1, dtype=torch.long), torch.ones(batch_size).long()
    samples: dict[int, list[float]] = {count: [] for count in counts}
    before = torch.get_num_threads()
    try:
        for round_ in range(rounds):  # the first round warms up (and chooses products' paths)
            for count in counts:
                torch.set_num_threads(count)
                start = time.perf_counter()
                target.score_tree(cache, root)
                if round_:
                    samples[count].append(time.perf_counter() - start)
                target.commit(cache, keep, one)  # keep the root: the context grows by one
    finally:
        torch.set_num_threads(before)
    return {count: statistics.median(times) for count, times in samples.items()}


def _key(model: torch.nn.Module, batch_size: int, counts: tuple[int, ...]) -> str:
    """A digest of what the choice depends on: the CPU, the cores timed, torch, the model's
    shapes and the batch size."""
    shapes = [(tuple(p.shape), str(p.dtype)) for p in model.parameters()]
    what = [cpu_model(), cpu_flags(), counts, torch.__version__, type(model).__qualname__]
    what += [shapes, batch_size]
    return hashlib.sha256(repr(what).encode()).hexdigest()[:20]
