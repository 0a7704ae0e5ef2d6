"""Training throughput (`genrec-spec bench train`): sequences (users) per second of the trainer's
own optimiser steps (`recsys.trainer.train_step`: windows, trees, forward, backward, clipping,
AdamW) over a fixed number of steps, validation left out; under torchrun, the users of every
process together (the global batch).

Variants (`--against train.batch_size=32`: one config field changed) train side by side with the
baseline in the same processes, taking turns block by block, so that the drift of a shared
machine hits them alike; each is reported with its ratio to the baseline. `--profile N` runs N
more baseline steps under torch.profiler and prints the operators that took the most time.

Columns:
  users/step   the mean global batch (an epoch's last batch can be smaller)
  seq/s        users trained on per second of optimiser steps
  seq/cpu-s    users per second of CPU time (user and system, every process's together): less
               sensitive than seq/s to other jobs on a shared machine
  ms/step      mean wall time of one optimiser step
  vs baseline  seq/s over the baseline's
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from genrec_spec.bench.errors import BenchError
from genrec_spec.machine import describe_device
from genrec_spec.models.recsys.config import RecommenderConfig
from genrec_spec.recsys.train_config import TrainConfig
from genrec_spec.recsys.train_run import TrainRun
from genrec_spec.recsys.trainer import (
    epoch_user_batches,
    finish_run,
    start_run,
    synchronized_time,
    train_step,
)


@dataclass(frozen=True)
class BenchTrainConfig:
    steps: int = 200  # timed optimiser steps per variant
    warmup: int = 5  # untimed steps per variant first (allocations, caches)
    block: int = 10  # steps one variant runs before the next takes its turn
    profile: int = 0  # baseline steps under torch.profiler after the timing (0: none)

    def __post_init__(self) -> None:
        if min(self.steps, self.block) < 1 or min(self.warmup, self.profile) < 0:
            raise BenchError(
                f"steps {self.steps} and block {self.block} must be >= 1, warmup "
                f"{self.warmup} and profile {self.profile} >= 0",
                "pass --steps and --block of 1 or more",
            )


@dataclass
class _Variant:
    name: str
    run: TrainRun
    batches: list[torch.Tensor] = field(default_factory=list)  # global batches still to train
    steps: int = 0
    sequences: int = 0
    seconds: float = 0.0
    cpu_seconds: float = 0.0  # this process's CPU time over the timed steps

    def next_batch(self) -> torch.Tensor:  # [B] int64 train rows
        if not self.batches:
            self.batches = epoch_user_batches(self.run)
        return self.batches.pop(0)

    def train(self, steps: int, timed: bool) -> None:
        start, cpu_start = synchronized_time(self.run), time.process_time()
        for _ in range(steps):
            users = self.next_batch()
            train_step(self.run, users)
            self.steps += timed
            self.sequences += len(users) if timed else 0
        if timed:
            self.seconds += synchronized_time(self.run) - start
            self.cpu_seconds += time.process_time() - cpu_start


def bench_training(
    data_dir: Path,
    variants: dict[str, tuple[RecommenderConfig, TrainConfig]],  # name -> configs; first: baseline
    config: BenchTrainConfig,
) -> dict:
    """{"rows": one dict per variant (name, steps, users_per_step, seq_per_s, seq_per_cpu_s,
    ms_per_step, ratio), "world_size", "rank", "threads", "device", "machine", "profile": the
    operator table or None}; under torchrun every process returns it."""
    if not variants:
        raise BenchError("no configs to time", "pass a --config or use the defaults")
    runs = [_Variant(name, start_run(data_dir, *configs)) for name, configs in variants.items()]
    try:
        for variant in runs:
            variant.run.model.train()
            variant.train(config.warmup, timed=False)
        for done in range(0, config.steps, config.block):
            for variant in runs:
                variant.train(min(config.block, config.steps - done), timed=True)
        table = _profile(runs[0], config.profile) if config.profile else None
        _sum_cpu_over_processes(runs)
    finally:
        finish_run(*(variant.run for variant in runs))
    base = runs[0].sequences / runs[0].seconds
    rows = [
        {
            "name": v.name,
            "steps": v.steps,
            "users_per_step": v.sequences / v.steps,
            "seq_per_s": v.sequences / v.seconds,
            "seq_per_cpu_s": v.sequences / max(v.cpu_seconds, 1e-9),
            "ms_per_step": 1000 * v.seconds / v.steps,
            "ratio": v.sequences / v.seconds / base,
        }
        for v in runs
    ]
    first = runs[0].run
    return {
        "rows": rows,
        "world_size": first.world,
        "rank": first.rank,
        "threads": torch.get_num_threads(),
        "device": str(first.device),
        "machine": describe_device(first.device),
        "profile": table,
    }


def _sum_cpu_over_processes(runs: list[_Variant]) -> None:
    """Each variant's CPU time summed over the processes (under torchrun)."""
    if not dist.is_initialized():
        return
    device = runs[0].run.device  # NCCL reduces device tensors only
    total = torch.tensor([v.cpu_seconds for v in runs], dtype=torch.float64, device=device)
    dist.all_reduce(total)
    for variant, seconds in zip(runs, total.tolist(), strict=True):
        variant.cpu_seconds = seconds


def _profile(variant: _Variant, steps: int) -> str:
    """torch.profiler's table of the operators that took the most time over `steps` steps."""
    activities = [ProfilerActivity.CPU]
    if variant.run.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        variant.train(steps, timed=False)
    key = "self_cuda_time_total" if variant.run.device.type == "cuda" else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=20)


def format_report(result: dict, data_dir: Path, config: BenchTrainConfig) -> str:
    lines = [
        f"training throughput: {data_dir}, {config.steps} steps per variant after "
        f"{config.warmup} untimed, turns of {config.block}; {result['world_size']} "
        f"process(es), {result['threads']} thread(s) each, {result['device']}",
        f"machine: {result['machine']}",
        f"{'variant':<36} {'users/step':>10} {'seq/s':>8} {'seq/cpu-s':>9} {'ms/step':>8} "
        f"{'vs baseline':>11}",
    ]
    for row in result["rows"]:
        lines.append(
            f"{row['name']:<36} {row['users_per_step']:>10.1f} {row['seq_per_s']:>8.1f} "
            f"{row['seq_per_cpu_s']:>9.1f} {row['ms_per_step']:>8.0f} {row['ratio']:>10.2f}x"
        )
    if result["profile"]:
        lines += [
            "",
            f"the baseline's top operators over {config.profile} steps:",
            result["profile"],
        ]
    return "\n".join(lines)
