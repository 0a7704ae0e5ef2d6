"""Resumable training: the state a run leaves after every epoch, so that a killed run continues
where it stopped and ends with the checkpoint the uninterrupted run would have written.

After each epoch but the last, rank 0 writes `<out>.resume.pt` beside the checkpoint folder (the
folder itself only ever appears complete, `checkpoint.py`), atomically: a temporary file renamed
over the previous state, so a kill at any moment leaves the last complete one. It holds what the
next epoch depends on: the weights, AdamW's state, the step counter and the planned schedule,
the best epoch's weights and record, the metrics so far, the epochs without improvement, the
training time spent against `max_minutes`, and the random generators of every process (the batch
order, each rank's windows and branch positions, torch's global generator that dropout draws
from, CUDA's). A resumed run restores all of it, so its remaining epochs repeat the uninterrupted
run's computation: the same weights and metrics, bit for bit where the arithmetic is the same
(machine, threads, processes).

The state names the run it belongs to (the model and training configs without the fields that
only choose how it executes, the data hash, the number of processes); `load_resume_state`
refuses another run's. Time counts per completed epoch: the part of an epoch that a kill cut
short, and the time until the restart, do not count against `max_minutes`. Every process reads
the state; rank 0 writes it, and removes it once the checkpoint is written.
"""

from __future__ import annotations

import io
import pickle
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

from genrec_spec.data_pipelines.atomic import atomic_write_bytes
from genrec_spec.recsys.errors import ResumeError
from genrec_spec.recsys.train_run import TrainRun

RESUME_VERSION = 1
# TrainConfig fields that choose how a run executes, not what it computes: a resumed run may set
# them differently.
RUN_ONLY_FIELDS = ("progress", "threads", "device")


@dataclass
class TrainProgress:
    """What the epoch loop carries from one epoch to the next, besides modules and generators."""

    history: list[dict] = field(default_factory=list)  # each completed epoch's record
    best: dict | None = None  # the best epoch's record
    best_state: dict[str, Tensor] | None = None  # the best epoch's weights
    stale: int = 0  # epochs since the best one
    elapsed_s: float = 0.0  # time of the completed epochs, across restarts, against max_minutes
    resumed_after: list[int] = field(default_factory=list)  # epochs a restart continued after

    @property
    def epoch(self) -> int:
        """The last completed epoch (0: none)."""
        return self.history[-1]["epoch"] if self.history else 0

    def add_epoch(self, record: dict, model: torch.nn.Module, keep_last: bool) -> None:
        """Append an epoch's record; a validated one becomes the best on a higher valid NDCG@10
        (or always, with `keep_last`), and its weights are kept. An epoch not validated
        (`TrainConfig.valid_from`) changes neither the best nor the count towards patience."""
        self.history.append(record)
        if "ndcg@10" not in record:
            return
        if self.best is None or record["ndcg@10"] > self.best["ndcg@10"] or keep_last:
            self.best, self.stale = record, 0
            self.best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        else:
            self.stale += 1


def resume_path(out: Path | str) -> Path:
    """Where the run whose checkpoint goes to `out` keeps its resume state: beside it."""
    out = Path(out).absolute()
    return out.with_name(out.name + ".resume.pt")


def check_resume_request(path: Path, *, resume: bool, overwrite: bool) -> None:
    """Refuse to start a run over a resume state nobody asked about: that would silently drop
    the epochs of an interrupted run."""
    if path.exists() and not path.is_file():
        raise ResumeError(
            f"{path} is a folder where the run keeps its resume state",
            "move it away, or pass another --out",
        )
    if path.is_file() and not resume and not overwrite:
        raise ResumeError(
            f"{path} holds the resume state of an interrupted run with this --out",
            "pass --resume to continue it, or --overwrite to start over and discard it",
        )


def run_identity(run: TrainRun) -> dict:
    """What a resume state must share with the run that loads it."""
    train_config = {k: v for k, v in asdict(run.config).items() if k not in RUN_ONLY_FIELDS}
    return {
        "model_config": asdict(run.model.config),
        "train_config": train_config,
        "data_hash": run.data.data_hash,
        "world_size": run.world,
    }


def save_resume_state(path: Path, run: TrainRun, progress: TrainProgress) -> None:
    """Write the resume state after an epoch. Every process calls it (each one's generators are
    gathered); rank 0 writes."""
    generators = _gather(_rank_generators(run), run)
    if run.rank != 0:
        return
    state = {
        "version": RESUME_VERSION,
        "identity": run_identity(run),
        "progress": {f.name: getattr(progress, f.name) for f in fields(progress)},
        "model": run.model.state_dict(),
        "optimizer": run.optimizer.state_dict(),
        "schedule": {
            "done_steps": run.done_steps,
            "planned_epochs": run.planned_epochs,
            "lr": run.lr,
        },
        "generators": generators,  # one dict per rank
    }
    buffer = io.BytesIO()
    torch.save(state, buffer)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, buffer.getvalue())


def load_resume_state(path: Path, run: TrainRun) -> TrainProgress:
    """Restore `run` (weights, optimizer, schedule, this process's generators) from the resume
    state at `path`, after checking it belongs to this run; returns the progress to go on from."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as err:
        first_line = (str(err).splitlines() or [""])[0]
        raise ResumeError(
            f"the resume state {path} cannot be read ({type(err).__name__}: "
            f"{_short(first_line, 80)})",
            "pass --overwrite to start the run over",
        ) from err
    if not isinstance(state, dict) or state.get("version") != RESUME_VERSION:
        raise ResumeError(
            f"{path} is not a resume state of version {RESUME_VERSION}, which this code reads",
            "resume it with the version that wrote it, or pass --overwrite to start over",
        )
    _check_identity(path, state["identity"], run_identity(run))
    run.model.load_state_dict(state["model"])
    run.optimizer.load_state_dict(state["optimizer"])
    schedule = state["schedule"]
    run.done_steps, run.planned_epochs = schedule["done_steps"], schedule["planned_epochs"]
    run.lr = schedule["lr"]
    _set_generators(run, state["generators"][run.rank])
    progress = TrainProgress(**state["progress"])
    progress.resumed_after.append(progress.epoch)
    return progress


def _check_identity(path: Path, saved: dict, current: dict) -> None:
    """Raise ResumeError naming what differs between the state's run and this one."""
    differences = []
    for section in ("model_config", "train_config"):
        prefix = section.removesuffix("_config")
        for key in sorted(set(saved[section]) | set(current[section])):
            was, now = saved[section].get(key), current[section].get(key)
            if was != now:
                differences.append(f"{prefix}.{key} {_short(repr(was))} -> {_short(repr(now))}")
    for key in ("data_hash", "world_size"):
        if saved[key] != current[key]:
            differences.append(f"{key} {saved[key]} -> {current[key]}")
    if differences:
        raise ResumeError(
            f"the resume state {path} belongs to another run: {'; '.join(differences[:6])}",
            "resume with the config, data and number of processes the run started with, or "
            "pass --overwrite to start over",
        )


def _short(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _rank_generators(run: TrainRun) -> dict[str, Tensor]:
    """This process's generator states."""
    states = {
        "torch": torch.get_rng_state(),
        "order": run.order_gen.get_state(),
        "local": run.local_gen.get_state(),
    }
    if run.device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(run.device)
    return states


def _set_generators(run: TrainRun, states: dict[str, Tensor]) -> None:
    torch.set_rng_state(states["torch"])
    run.order_gen.set_state(states["order"])
    run.local_gen.set_state(states["local"])
    if run.device.type == "cuda" and "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"], run.device)


def _gather(states: dict[str, Tensor], run: TrainRun) -> list[dict[str, Tensor]]:
    """Every process's `states`, by rank (a collective: every process calls it)."""
    if run.world == 1:
        return [states]
    every: list = [None] * run.world
    dist.all_gather_object(every, states)
    return every
