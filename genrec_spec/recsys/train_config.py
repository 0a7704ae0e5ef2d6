"""The training configuration: `TrainConfig` and the JSON config files that set it.

A config file is JSON with two optional sections, {"model": {...}, "train": {...}}, whose keys
are the fields of `RecommenderConfig` (models/recsys/config.py) and `TrainConfig` (below);
missing keys keep their defaults. `load_config` reads one, with overrides (the command line's).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from genrec_spec.errors import GenrecError
from genrec_spec.models.recsys.config import (
    ConfigError,
    RecommenderConfig,
    config_from_dict,
    convert_flat_config,
    is_flat_config,
)


class TrainConfigError(GenrecError):
    """A training config that cannot be used (unknown keys, values out of range)."""


@dataclass(frozen=True)
class TrainConfig:
    """Training defaults, one place."""

    seed: int = 0  # seeds the weights, the batch order, the windows and the branch positions
    # Most epochs; the cosine schedule spans them, or the fewer that fit in max_minutes.
    epochs: int = 40
    max_minutes: float = 43.0  # no epoch starts that would end past this wall time; 0 = none
    # Small batches and a high rate: where the time budget, not the data, limits training, more
    # updates per epoch win.
    batch_size: int = 16  # users per optimiser step, summed over processes
    lr: float = 4e-3  # AdamW peak learning rate
    weight_decay: float = 0.1  # AdamW weight decay (not on biases, norms, embeddings)
    warmup_steps: int = 200  # linear warm-up, then cosine decay to 10% of lr
    grad_clip: float = 1.0  # max gradient norm
    # History positions per user per step that get a code branch: levels >= 1 learn there only
    # (level 0 at every position).
    branches_per_row: int = 64
    window: str = "random"  # "random" | "last": which max_len + 1 items of a long user to read
    # Fixed random subset of valid users scored per epoch (0 = all): the early-stopping and
    # checkpoint signal, whose noise falls as it holds more users.
    valid_users: int = 2048
    # The first epoch validated. Validation costs up to a third of an epoch, and under the
    # cosine schedule the best epoch comes late: earlier epochs train only (and do not count
    # towards patience). The last epoch is always validated, so it needs max_minutes 0.
    valid_from: int = 1
    eval_batch_size: int = 64  # users per validation pass
    eval_chunk: int = 32  # scored prefix nodes per tree pass in validation
    patience: int = 10  # epochs without a better valid NDCG@10 before stopping (it is noisy)
    freeze_backbone: bool = False  # train only the heads (start from `init_from`)
    init_from: str | None = None  # checkpoint folder to start from (same data)
    # torch threads per process; 0 = cores / processes. One suits a small model on a few shared
    # cores.
    threads: int = 1
    device: str = "auto"  # "auto" (cuda when available) | "cpu" | "cuda"
    # "fp32", or "bf16": the forward's matrix products in bfloat16 (torch.autocast; weights,
    # optimiser and losses stay fp32), for CPUs with bf16 instructions and GPUs
    precision: str = "fp32"
    progress: bool = True  # progress bars (the per-epoch summary line prints regardless)

    def __post_init__(self) -> None:
        sizes = (self.batch_size, self.epochs, self.branches_per_row, self.eval_batch_size)
        if min(*sizes, self.eval_chunk) < 1:
            raise TrainConfigError(
                f"train.batch_size {self.batch_size}, epochs {self.epochs}, branches_per_row "
                f"{self.branches_per_row}, eval_batch_size {self.eval_batch_size} and eval_chunk "
                f"{self.eval_chunk} must be >= 1",
                "use values of 1 or more",
            )
        if self.device not in ("auto", "cpu", "cuda"):
            raise TrainConfigError(
                f"train.device must be auto, cpu or cuda, got {self.device!r}",
                'use "auto" (cuda when there is one), "cpu" or "cuda"',
            )
        if self.window not in ("random", "last"):
            raise TrainConfigError(
                f"train.window must be random or last, got {self.window!r}",
                'use "random" or "last"',
            )
        if self.precision not in ("fp32", "bf16"):
            raise TrainConfigError(
                f"train.precision must be fp32 or bf16, got {self.precision!r}",
                'use "fp32" or "bf16"',
            )
        if not 1 <= self.valid_from <= self.epochs:
            raise TrainConfigError(
                f"train.valid_from = {self.valid_from} must lie in 1..epochs ({self.epochs})",
                "validate from an epoch the run reaches (1: every epoch)",
            )
        if self.valid_from > 1 and self.max_minutes:
            raise TrainConfigError(
                f"train.valid_from = {self.valid_from} with a time budget (max_minutes "
                f"{self.max_minutes}): the budget may end the run before it validates",
                "set train.max_minutes to 0 (run every epoch) or train.valid_from to 1",
            )
        if self.freeze_backbone and not self.init_from:
            raise TrainConfigError(
                "train.freeze_backbone needs train.init_from",
                "set train.init_from to a trained checkpoint whose backbone the heads train on",
            )
        if not (self.lr > 0 and self.grad_clip > 0):
            raise TrainConfigError(
                f"train.lr {self.lr} and grad_clip {self.grad_clip} must be > 0",
                "use a positive learning rate (e.g. 0.004) and gradient norm bound (e.g. 1.0)",
            )
        counts = ("weight_decay", "warmup_steps", "max_minutes", "valid_users", "patience")
        negative = [f"{n} {getattr(self, n)}" for n in (*counts, "threads") if getattr(self, n) < 0]
        if negative:
            raise TrainConfigError(
                f"train {', '.join(negative)} must be >= 0",
                "use 0 or more (TrainConfig says what 0 means for each)",
            )


def load_config(
    path: Path | str | None, overrides: dict | None = None
) -> tuple[RecommenderConfig, TrainConfig]:
    """(RecommenderConfig, TrainConfig) from a JSON file (None: defaults) and `overrides`
    ({"train": {...}, "model": {...}}, each key replacing the file's); unknown sections or keys
    raise, listing the valid ones. A model section in the flat form of older config files is
    converted (`convert_flat_config`)."""
    raw = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            what = "is a folder" if path.is_dir() else "does not exist"
            raise TrainConfigError(
                f"config file {path} {what}", "pass a JSON file such as configs/ml-1m.json"
            )
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise TrainConfigError(
                f"config file {path} is not valid JSON: {err}", "fix the JSON syntax"
            ) from err
    if not isinstance(raw, dict):
        raise TrainConfigError(
            f"config file {path} holds {type(raw).__name__}, not a JSON object",
            'write {"model": {...}, "train": {...}}',
        )
    sections = ("model", "train")
    unknown = set(raw) - set(sections)
    if unknown:
        raise TrainConfigError(
            f"config {path} has unknown sections {sorted(unknown)}; valid: {sorted(sections)}",
            "remove or rename them",
        )
    overrides = overrides or {}
    model, extra = dict(raw.get("model", {})), dict(overrides.get("model", {}))
    if is_flat_config(model) and is_flat_config(extra):  # one flat config, then converted
        model, extra = model | extra, {}
    model = convert_flat_config(model) | convert_flat_config(extra)
    train = dict(raw.get("train", {})) | dict(overrides.get("train", {}))
    try:
        model_config = RecommenderConfig.from_dict(model)
        train_config = config_from_dict(TrainConfig, train, "train")
    except ConfigError as err:
        raise TrainConfigError(f"config {path}: {err.problem}", err.fix) from None
    return model_config, train_config
