"""Offline A/B replay of two recommendation arms with paired bootstrap statistics.

`run_replay` loads both arms' models and the events, decodes the events with both arms in the
same batches (`replay_arms`) and compares them (`replay_compare`): every difference B - A is
measured on paired events. Events come from a split or a log (`replay_events`); the output
files are written by `replay_report`.

Shape letters: E events, NB batches, I items.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from torch import Tensor

from genrec_spec.jobs.errors import ReplayInputError
from genrec_spec.jobs.replay_arms import Arm, ArmRun, ReplayConfig, replay
from genrec_spec.jobs.replay_compare import compare
from genrec_spec.jobs.replay_events import Events, log_events, read_log, split_events
from genrec_spec.recsys.checkpoint import load_checkpoint, load_model_and_data


@dataclass(frozen=True)
class ReplayResult:
    """Everything `replay_report` writes."""

    events: Events
    arms: tuple[Arm, Arm]
    runs: tuple[ArmRun, ArmRun]
    batch_offsets: Tensor  # [NB+1] int64 events of each batch
    item_ids: list[str]  # [I] raw id of each item index
    summary: dict  # metrics.json
    per_event: dict[str, Tensor]  # column name -> [E]


def run_replay(
    arm_a: Arm,
    arm_b: Arm,
    config: ReplayConfig,
    *,
    split: str | None = None,
    log: Path | None = None,
    data_dir: Path | None = None,  # prepared data; default: the one A was trained on
) -> ReplayResult:
    """Load both arms' models and the events (exactly one of split / log), replay, compare."""
    if (split is None) == (log is None):
        raise ReplayInputError(
            "replay needs exactly one event source", "give a split or a log file, not both"
        )
    model_a, data = load_model_and_data(arm_a.ckpt, data_dir)
    if (data.path / "interactions.parquet").is_file():  # events in time order, with their times
        data = data.with_times()
    model_b = model_a
    if Path(arm_b.ckpt).resolve() != Path(arm_a.ckpt).resolve():
        model_b, manifest = load_checkpoint(arm_b.ckpt)
        trained_on = manifest.get("data", {}).get("data_hash")
        if trained_on != data.data_hash:
            raise ReplayInputError(
                f"--ckpt-b {arm_b.ckpt} was trained on data {trained_on} but --ckpt "
                f"{arm_a.ckpt} on data {data.data_hash} ({data.path}); an A/B replay compares "
                "models of the same data",
                "pass two checkpoints trained on one prepared folder",
            )
    if not config.k <= model_a.num_items:
        raise ReplayInputError(
            f"--k {config.k} exceeds the catalogue ({model_a.num_items} items)",
            f"ask for at most {model_a.num_items} items",
        )
    if split is not None:
        events = split_events(data, split, config.users, config.seed)
    else:
        keep = max(model_a.config.max_len, model_b.config.max_len)
        events = log_events(data, read_log(log), config.users, config.seed, keep, f"log {log}")
    if len(events.histories) == 0:
        raise ReplayInputError(
            f"the {events.source} has no events to replay", "replay a split or log with events"
        )
    arms = (arm_a, arm_b)
    run_a, run_b, batch_offsets = replay(
        (model_a, model_b), arms, events, config.k, config.batch_size
    )
    summary, per_event = compare(events, arms, (run_a, run_b), batch_offsets, config)
    summary["replay"] |= {"data": str(data.path), "data_hash": data.data_hash}
    return ReplayResult(
        events, arms, (run_a, run_b), batch_offsets, data.item_ids, summary, per_event
    )
