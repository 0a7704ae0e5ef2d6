"""What every trained drafter's training shares: the held-out split by whole prompts, the
optimisation loop (AdamW, linear warm-up then cosine decay to 0, a progress bar and the running
loss printed every few steps) and the manifest saved beside the weights."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import asdict
from typing import Any, Protocol

import torch
from torch import Tensor
from tqdm import tqdm

from genrec_spec.llm.training.checkpoint import target_info
from genrec_spec.llm.training.selfdistill import SelfDistillData


def held_out_rows(rows: int, held_out: float, seed: int) -> Tensor:  # [R] bool
    """Which rows (prompts) are held out: a share ``held_out`` of them, at least one when there
    are two rows or more, none when there is one (it must train)."""
    order = torch.randperm(rows, generator=torch.Generator().manual_seed(seed))
    count = min(max(1, round(held_out * rows)), rows - 1) if held_out > 0 else 0
    held = torch.zeros(rows, dtype=torch.bool)
    held[order[:count]] = True
    return held


class Schedule(Protocol):
    """The optimisation settings every drafter's config carries."""

    steps: int  # optimiser steps
    lr: float  # AdamW peak learning rate
    weight_decay: float
    warmup: int  # linear warm-up steps, then cosine decay to 0
    log_every: int  # print the running loss every this many steps


def fit(
    parameters: Iterable[torch.nn.Parameter],
    step: Callable[[], float],
    schedule: Schedule,
    *,
    desc: str,
    progress: bool = True,
) -> float | None:
    """Run ``schedule.steps`` optimiser steps; ``step()`` draws its batch, accumulates the
    gradient of its loss and returns the loss. Returns the running loss (exponential average,
    0.9) at the end."""
    steps, warmup, log_every = schedule.steps, schedule.warmup, schedule.log_every
    optimizer = torch.optim.AdamW(parameters, schedule.lr, weight_decay=schedule.weight_decay)

    def factor(index: int) -> float:
        decay = 0.5 * (1 + math.cos(math.pi * index / steps))
        return min(1.0, (index + 1) / max(warmup, 1)) * decay

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    running, bar = None, tqdm(range(steps), desc=desc, disable=not progress)
    for index in bar:
        optimizer.zero_grad(set_to_none=True)
        loss = step()
        optimizer.step()
        scheduler.step()
        running = loss if running is None else 0.9 * running + 0.1 * loss
        bar.set_postfix(loss=f"{running:.3f}")
        if (index + 1) % log_every == 0 or index + 1 == steps:
            bar.write(f"step {index + 1}/{steps} loss {running:.4f}")
    return running


def drafter_manifest(
    kind: str,
    model: Any,
    data: SelfDistillData,
    config: Any,  # the drafter's config dataclass (has ``steps``)
    train_loss: float | None,
    held_out: dict[str, Any] | None,
    extra: dict[str, Any] | None = None,
    hidden_layer: int | list[int] | None = None,
) -> dict[str, Any]:
    """The manifest of a drafter trained on ``data`` for the native Llama ``model``, reading its
    hidden state ``hidden_layer`` (default its final-normed one, layer ``n_layers``; EAGLE-3:
    the list of layers it fuses)."""
    layer = model.config.n_layers if hidden_layer is None else hidden_layer
    return {
        "kind": kind,
        "target": {**target_info(model), "hidden_layer": layer},
        "data": {"key": data.key, "rows": data.rows, "positions": len(data.tokens)},
        "config": asdict(config),
        "steps": config.steps,
        "train_loss": train_loss,
        "held_out": held_out,
        **(extra or {}),
    }
