"""One training run's state (`TrainRun`): what the trainer's epochs share, what a resume state
saves and restores (`resume.py`), and what `bench train` steps.

Its own module so that `trainer.py` and `resume.py` both read the type without importing each
other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from genrec_spec.models.recsys.recommender import SemanticIdRecommender
from genrec_spec.recsys.data import PreparedData
from genrec_spec.recsys.train_config import TrainConfig


@dataclass
class TrainRun:
    """One training run's state, shared by its epochs."""

    config: TrainConfig
    data: PreparedData
    model: SemanticIdRecommender
    ddp: torch.nn.Module | None  # the model, or its DistributedDataParallel wrapper
    trainable: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    rank: int
    world: int
    device: torch.device
    order_gen: torch.Generator  # the batch order, the same on every rank
    local_gen: torch.Generator  # this rank's windows and branch positions
    steps_per_epoch: int
    # The cosine decay spans the epochs planned: `epochs`, or fewer once the time budget (at
    # the speed of the epoch just run) would run out first, so a run cut by `max_minutes` still
    # ends at a low learning rate.
    planned_epochs: int
    lr: float
    done_steps: int = 0
