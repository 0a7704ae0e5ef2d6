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

import functools
import os
from pathlib import Path

import torch

from genrec_spec.cache import cache_dir
from genrec_spec.core.targets import as_target
from genrec_spec.core.types import DraftTree
from genrec_spec.data_pipelines.atomic import json_made_once
from genrec_spec.machine import describe, machine_key, time_in_turns

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
    shapes = [(tuple(p.shape), str(p.dtype)) for p in model.parameters()]
    key = machine_key("threads", counts, type(model).__qualname__, shapes, batch_size)

    def measure() -> dict:
        seconds = time_threads(model, batch_size, counts)
        return {
            "threads": min(seconds, key=seconds.get),
            "step_ms": {count: s * 1e3 for count, s in seconds.items()},
            "machine": describe(),
        }

    record = json_made_once(folder / f"{key}.json", measure, lambda r: r["threads"] in counts)
    return int(record["threads"])


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

    def step(count: int) -> None:  # setting the count costs microseconds of a step's ~100 ms
        torch.set_num_threads(count)
        target.score_tree(cache, root)

    before = torch.get_num_threads()
    try:
        return time_in_turns(
            {count: functools.partial(step, count) for count in counts},
            REPEATS,
            after=lambda count: target.commit(cache, keep, one),  # the context grows by one
        )
    finally:
        torch.set_num_threads(before)
