"""The training loop of `genrec-spec train` (its config: `train_config.py`).

One step: a global batch of users (the same on every process) -> each process takes its share
-> training windows -> one tree per user (`models.recsys.layout.train_layout`) ->
`forward_train` losses -> AdamW. After each epoch the validation users are ranked by the
model's exact item trie-constrained log-likelihoods (`models.recsys.item_scores`: every
catalogue item as a branch of prefix trees over the history) and by the PinRec / RPG heads'
item scores; early stopping watches the exact NDCG@10. Each epoch reports its training
throughput (`seq_per_s`: users per second of the optimiser steps, validation excluded) and
leaves a resume state (`resume.py`) that a restarted run continues from.
"""

from __future__ import annotations

import gc
import math
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from genrec_spec.data_pipelines.atomic import check_output_dir, check_writable_folder
from genrec_spec.machine import cpu_flags, cpu_model, finish
from genrec_spec.models.recsys.config import RecommenderConfig
from genrec_spec.models.recsys.item_scores import item_log_likelihoods
from genrec_spec.models.recsys.layout import train_layout
from genrec_spec.models.recsys.recommender import SemanticIdRecommender
from genrec_spec.recsys.checkpoint import load_checkpoint, save_checkpoint
from genrec_spec.recsys.data import (
    Histories,
    PreparedData,
    epoch_batches,
    load_prepared,
    training_windows,
)
from genrec_spec.recsys.decoders import nezha
from genrec_spec.recsys.decoders.beam import beam_width_for
from genrec_spec.recsys.item_trie import item_trie
from genrec_spec.recsys.metrics import per_user_metrics, ranks_from_topk
from genrec_spec.recsys.resume import (
    TrainProgress,
    check_resume_request,
    load_resume_state,
    resume_path,
    save_resume_state,
)
from genrec_spec.recsys.train_config import TrainConfig, TrainConfigError
from genrec_spec.recsys.train_run import TrainRun

EVAL_K = 10


def train(
    data_dir: Path,
    out: Path,
    model_config: RecommenderConfig,
    config: TrainConfig,
    *,
    overwrite: bool = False,
    resume: bool = False,
) -> dict | None:
    """Train, validate, early-stop and write the checkpoint; returns its manifest on rank 0
    (None on the other ranks). After every epoch but the last a resume state is left beside
    `out` (`resume.resume_path`). `resume` continues the interrupted run from it (or starts
    afresh where there is none); `overwrite` replaces an existing `out` and, without `resume`,
    starts over, discarding the resume state."""
    out = Path(out)
    check_train_output(Path(data_dir), out, overwrite=overwrite)  # before hours of training
    state_file = resume_path(out)
    check_resume_request(state_file, resume=resume, overwrite=overwrite)
    run = start_run(data_dir, model_config, config)
    if run.rank == 0 and slow_bf16(config, run.device):
        print(
            f"warning: train.precision bf16 on a CPU without bf16 instructions ({cpu_model()}, "
            f"flags {' '.join(cpu_flags())}) runs several times slower than fp32; "
            "set train.precision to fp32 here",
            file=sys.stderr,
            flush=True,
        )
    progress = _resume_or_start(run, state_file, resume)
    start_time = time.perf_counter() - progress.elapsed_s
    valid_rows = _validation_rows(run.data.valid, config)[run.rank :: run.world]
    for epoch in range(progress.epoch + 1, config.epochs + 1):
        epoch_start = time.perf_counter()
        record = _train_epoch(run, epoch)
        if epoch >= config.valid_from:
            valid = validate(run.model, run.data, run.data.valid, valid_rows, config, run.device)
            record.update(valid)
        record["epoch_s"] = round(time.perf_counter() - epoch_start, 2)
        if run.rank == 0:
            print(_format_epoch(record), flush=True)
        # A frozen backbone's ranking cannot move, so its heads keep the last (annealed) epoch.
        progress.add_epoch(record, run.model, keep_last=config.freeze_backbone)
        elapsed_s = time.perf_counter() - start_time
        if _should_stop(run, epoch, progress.stale, elapsed_s, record["epoch_s"]):
            break
        progress.elapsed_s = elapsed_s
        save_resume_state(state_file, run, progress)

    run.model.load_state_dict(progress.best_state)
    manifest = None
    if run.rank == 0:
        manifest = save_checkpoint(
            out,
            run.model,
            {
                "data": {
                    "path": str(Path(data_dir).resolve()),
                    "data_hash": run.data.data_hash,
                    "name": run.data.manifest.get("name"),
                },
                "train_config": asdict(config),
                "metrics": progress.history,
                "best": progress.best,
                "stopped_after_epoch": progress.epoch,
                "resumed_after_epochs": progress.resumed_after,
                "world_size": run.world,
                "device": str(run.device),
                "threads": torch.get_num_threads(),
                # The epochs' time across restarts (not the time the run lay killed).
                "wall_time_s": round(time.perf_counter() - start_time, 1),
            },
            overwrite=overwrite,
        )
        state_file.unlink(missing_ok=True)
    finish_run(run)
    return manifest


def _resume_or_start(run: TrainRun, state_file: Path, resume: bool) -> TrainProgress:
    """The progress of the interrupted run `state_file` holds (restored into `run`) when
    resuming, else a fresh start (a stale state removed: --overwrite)."""
    if resume and state_file.is_file():
        progress = load_resume_state(state_file, run)
        if run.rank == 0:
            print(f"resuming after epoch {progress.epoch} from {state_file}", flush=True)
        return progress
    if run.rank == 0:
        if resume:
            print(f"no resume state at {state_file}: starting at epoch 1", flush=True)
        state_file.unlink(missing_ok=True)
    return TrainProgress()


def start_run(data_dir: Path, model_config: RecommenderConfig, config: TrainConfig) -> TrainRun:
    """The processes, the data, the model (seeded), its optimizer and the generators."""
    rank, world, device = _setup_processes(config)
    torch.manual_seed(config.seed)
    data = load_prepared(data_dir)
    if model_config.time_bias:  # the model reads every item's timestamp
        data = data.with_times()
    model = _build_model(data, model_config, config).to(device)
    ddp = model
    if world > 1:
        ddp = DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )
    return TrainRun(
        config=config,
        data=data,
        model=model,
        ddp=ddp,
        trainable=[p for p in model.parameters() if p.requires_grad],
        optimizer=torch.optim.AdamW(_param_groups(model, config.weight_decay), lr=config.lr),
        rank=rank,
        world=world,
        device=device,
        order_gen=torch.Generator().manual_seed(config.seed),
        local_gen=torch.Generator().manual_seed(config.seed * 1000 + 1 + rank),
        steps_per_epoch=max(1, int((data.train.lengths > 0).sum()) // config.batch_size),
        planned_epochs=config.epochs,
        lr=config.lr,
    )


def _train_epoch(run: TrainRun, epoch: int) -> dict:
    """One epoch of optimiser steps: {epoch, steps, lr, train_s, seq_per_s, train_<loss>
    (per-step means)}; `train_s` times the steps alone and `seq_per_s` is the users they
    trained on per second (every process's together)."""
    config = run.config
    run.model.train()
    batches = epoch_user_batches(run)
    sums: dict[str, torch.Tensor] = {}
    bar = tqdm(
        batches,
        desc=f"epoch {epoch}",
        disable=not config.progress or run.rank != 0,
        leave=False,
        dynamic_ncols=True,
    )
    start = time.perf_counter()
    for step, users in enumerate(bar):
        losses = train_step(run, users)
        for name, value in losses.items():
            sums[name] = sums.get(name, 0.0) + value.detach()
        if step % 20 == 0:
            bar.set_postfix(loss=f"{float(losses['loss'].detach()):.3f}")
    train_s = synchronized_time(run) - start
    sequences = sum(len(users) for users in batches)
    record = {
        "epoch": epoch,
        "steps": len(batches),
        "lr": run.lr,
        "train_s": round(train_s, 2),
        "seq_per_s": round(sequences / max(train_s, 1e-9), 2),
    }
    return record | _mean_over_processes(sums, len(batches))


def epoch_user_batches(run: TrainRun) -> list[torch.Tensor]:  # each [B] int64 train rows
    """The next epoch's global batches of users (the same on every process), drawn from the
    run's batch-order generator; a last batch too small to give every process a user is
    dropped."""
    batches = epoch_batches(run.data.train.lengths, run.config.batch_size, run.order_gen)
    return [users for users in batches if len(users) >= run.world]


def train_step(run: TrainRun, users: torch.Tensor) -> dict[str, torch.Tensor]:
    """One optimiser step on a global batch of users (`users`: [B] train rows; this process
    takes every world-th): the schedule's learning rate, training windows, one tree per user,
    the losses, backward, clipping, AdamW. Returns the losses (undetached)."""
    config, model = run.config, run.model
    total_steps = run.planned_epochs * run.steps_per_epoch
    run.lr = config.lr * _warmup_cosine(run.done_steps, config.warmup_steps, total_steps)
    for group in run.optimizer.param_groups:
        group["lr"] = run.lr
    part = run.data.train.select(users[run.rank :: run.world])
    values, offsets, times = training_windows(
        part, model.config.max_len + 1, config.window, run.local_gen
    )
    layout = train_layout(
        values, offsets, model.num_levels - 1, config.branches_per_row, run.local_gen, times
    ).to(run.device)
    bf16 = config.precision == "bf16"
    with torch.autocast(run.device.type, dtype=torch.bfloat16, enabled=bf16):
        losses = run.ddp(layout)
    run.optimizer.zero_grad(set_to_none=True)
    losses["loss"].backward()
    torch.nn.utils.clip_grad_norm_(run.trainable, config.grad_clip)
    run.optimizer.step()
    run.done_steps += 1
    return losses


def slow_bf16(config: TrainConfig, device: torch.device) -> bool:
    """Whether bf16 autocast is asked of a CPU that has no bf16 instructions (AVX512-BF16 or
    AMX), where its products are emulated: several times slower than fp32 (measured:
    docs/results/recsys-quality.md, bf16 autocast)."""
    native = {"avx512_bf16", "amx_bf16"} & set(cpu_flags())
    return config.precision == "bf16" and device.type == "cpu" and not native


def synchronized_time(run: TrainRun) -> float:
    """`time.perf_counter()` once the device has finished the work queued so far."""
    finish(run.device)
    return time.perf_counter()


def _should_stop(run: TrainRun, epoch: int, stale: int, elapsed_s: float, epoch_s: float) -> bool:
    """Stop early, or when another epoch like this one would overrun the time budget; the
    decisions are shared, so no process is left waiting and all use one learning rate."""
    config = run.config
    if config.max_minutes:
        run.planned_epochs = _epochs_that_fit(epoch, config, elapsed_s, epoch_s)
    stop = stale >= config.patience or run.planned_epochs <= epoch
    if run.world > 1:
        flags = torch.tensor([float(stop), -float(run.planned_epochs)], device=run.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        stop, run.planned_epochs = bool(flags[0].item()), int(-flags[1].item())
    return stop


def finish_run(*runs: TrainRun) -> None:
    """Leave the process group (under torchrun) once, after freeing the DDP wrapper of every
    run that shares it (`bench train` runs several side by side)."""
    if runs[0].world > 1:
        # Free DDP's reducer while the process group is still registered. Freed after
        # destroy_process_group, the reducer held the group's last reference and destroyed it
        # from a destructor that keeps the GIL while joining gloo's worker threads, one of which
        # needed the GIL to drop a finished collective's tensors: a worker hung at exit, now and
        # then under load (seen with py-spy). The group's own handle releases the GIL first.
        for run in runs:
            run.ddp = None
        gc.collect()  # in case the module's hooks hold the reducer in a reference cycle
        dist.barrier()
        dist.destroy_process_group()


@torch.no_grad()
def validate(
    model: SemanticIdRecommender,
    data: PreparedData,
    split: Histories,
    rows: torch.Tensor,  # [U'] rows of `split` this process scores
    config: TrainConfig,
    device: torch.device,
) -> dict[str, float]:
    """HR@10 / NDCG@10 over `rows` (summed over processes): `hr@10`, `ndcg@10` from the exact
    item log-likelihoods, `parallel_*` / `long_id_*` from the heads' item scores, `item_*` from the
    item objective's (a model with one), `draft_*` from the `nezha` decoder's lists (with a
    draft head); `nll`, the mean negative exact log-likelihood of the targets (a far less noisy
    signal than HR@10 on a few hundred users)."""
    model.eval()
    items = torch.arange(data.num_items, device=device)
    trie = item_trie(model)
    width = beam_width_for(EVAL_K, None, data.num_items)  # the nezha decoder's default
    sums: dict[str, torch.Tensor] = {}
    for part in rows.split(config.eval_batch_size):
        users = split.select(part).to(device)
        state = model.encode_history(users.values, users.offsets, users.history_times())
        targets = users.targets
        scores = {"": item_log_likelihoods(model, state, items, chunk=config.eval_chunk)}
        target_ll = scores[""].gather(1, targets[:, None])  # [B', 1]
        sums["nll"] = sums.get("nll", 0.0) - target_ll.sum()
        if model.parallel_heads is not None:
            scores["parallel_"] = model.parallel_heads.score_items(state.hidden, model.item_codes)
        if model.item_objective is not None:
            scores["item_"] = model.item_scores(state.hidden)
        if model.long_id_heads is not None:
            scores["long_id_"] = model.long_id_heads.score_items(state.hidden, model.long_ids)
        lists = {prefix: score.topk(EVAL_K, dim=1).indices for prefix, score in scores.items()}
        if model.draft_head is not None:  # the nezha decoder's lists, from the same state
            lists["draft_"] = nezha.search(model, state, trie, EVAL_K, width)[0]
        for prefix, top in lists.items():
            ranks = ranks_from_topk(top, targets)
            for name, per_user in per_user_metrics(ranks, (EVAL_K,), EVAL_K).items():
                if name != "mrr":
                    sums[prefix + name] = sums.get(prefix + name, 0.0) + per_user.sum()
        sums["users"] = sums.get("users", 0.0) + len(part)
    names = sorted(sums)
    total = torch.tensor([float(sums[n]) for n in names], dtype=torch.float64, device=device)
    if dist.is_initialized():  # NCCL reduces CUDA tensors only, hence `device`
        dist.all_reduce(total)
    count = total[names.index("users")]
    return {
        n: round(float(v / count), 5) for n, v in zip(names, total, strict=True) if n != "users"
    } | {"valid_users": int(count)}


def _mean_over_processes(sums: dict[str, torch.Tensor], steps: int) -> dict[str, float]:
    """Per-step mean of each training loss, averaged over processes: `train_<name>`."""
    names = sorted(sums)
    if not names:
        return {}
    total = torch.stack([sums[n].float() for n in names]) / max(1, steps)
    if dist.is_initialized():
        dist.all_reduce(total)
        total /= dist.get_world_size()
    return {f"train_{n}": float(v) for n, v in zip(names, total, strict=True)}


def check_train_output(data_dir: Path, out: Path, *, overwrite: bool) -> None:
    """Refuse a checkpoint folder the run could not write, or must not replace: a file, a
    non-empty folder without `overwrite`, the data folder or one holding it (replacing it would
    delete the data), or one whose parent cannot hold files (the resume state and the temporary
    names go there: found only after the first epoch otherwise)."""
    check_output_dir(out, overwrite=overwrite)
    target = out.resolve()
    if target == data_dir.resolve() or target in data_dir.resolve().parents:
        raise TrainConfigError(
            f"--out {out} is the data folder {data_dir} or holds it: writing the checkpoint "
            "there would replace the data",
            "pass another --out, e.g. a folder beside the data",
        )
    check_writable_folder(out.absolute().parent)


def check_device(config: TrainConfig) -> None:
    """Refuse train.device cuda where no GPU is visible (before a job's earlier steps)."""
    if config.device == "cuda" and not torch.cuda.is_available():
        raise TrainConfigError(
            "train.device is cuda but no CUDA GPU is visible", "use train.device auto or cpu"
        )


def _setup_processes(config: TrainConfig) -> tuple[int, int, torch.device]:
    """(rank, world size, device); starts the process group under torchrun (once: runs side by
    side, as `bench train` has them, share it)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    use_cuda = config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())
    check_device(config)
    rank, device = 0, torch.device("cpu")
    if world > 1:
        if not dist.is_initialized():
            dist.init_process_group("nccl" if use_cuda else "gloo")
        rank = dist.get_rank()
    if use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    threads = config.threads or max(1, (os.cpu_count() or 1) // local_world)
    torch.set_num_threads(threads)
    return rank, world, device


def _build_model(
    data: PreparedData, model_config: RecommenderConfig, config: TrainConfig
) -> SemanticIdRecommender:
    model = SemanticIdRecommender(
        model_config, data.item_codes, data.codebook_sizes, data.long_ids, data.long_id_sizes
    )
    if config.init_from:
        start, manifest = load_checkpoint(config.init_from)
        if manifest["data"]["data_hash"] != data.data_hash:
            raise TrainConfigError(
                f"train.init_from {config.init_from} was trained on data {manifest['data']} "
                f"but --data has hash {data.data_hash}",
                "start from a checkpoint of this data",
            )
        heads = ("parallel_heads", "long_id_heads", "draft_head")
        head_names = {n for n, _ in model.named_parameters() if n.split(".")[0] in heads}
        missing, unexpected = model.load_state_dict(start.state_dict(), strict=False)
        if set(missing) - head_names or unexpected:
            raise TrainConfigError(
                f"train.init_from {config.init_from} does not match the model config "
                f"(missing {sorted(set(missing) - head_names)[:5]}, unexpected "
                f"{unexpected[:5]})",
                "use the checkpoint's model section in the config",
            )
    if config.freeze_backbone:
        for p in model.backbone_parameters():
            p.requires_grad_(False)
    # A head whose loss weight is 0 learns nothing, so it is frozen: AdamW's weight decay would
    # otherwise shrink its weights (retraining one head on a frozen backbone keeps the others).
    heads = (
        (model.parallel_heads, model_config.parallel_heads),
        (model.long_id_heads, model_config.long_id_heads),
        (model.draft_head, model_config.draft_head),
    )
    for head, head_config in heads:
        if head is not None and not head_config.weight:
            head.requires_grad_(False)
    return model


def _param_groups(model: SemanticIdRecommender, weight_decay: float) -> list[dict]:
    """Weight decay on matrices of linear layers only (not embeddings, biases, norms)."""
    decay, rest = [], []
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if not p.requires_grad:
                continue
            is_matrix = isinstance(module, torch.nn.Linear) and name == "weight"
            (decay if is_matrix else rest).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def _epochs_that_fit(done: int, config: TrainConfig, elapsed_s: float, epoch_s: float) -> int:
    """`done` epochs plus as many more as end within `max_minutes` if each takes `epoch_s` like
    the last one, at most `epochs` (<= done: stop now)."""
    left_s = config.max_minutes * 60 - elapsed_s
    return min(config.epochs, done + math.floor(left_s / max(epoch_s, 0.01)))


def _warmup_cosine(step: int, warmup: int, total: int) -> float:
    """Learning-rate factor: linear warm-up, then cosine decay to 0.1 at step `total`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def _validation_rows(valid: Histories, config: TrainConfig) -> torch.Tensor:  # [U'] int64
    """A fixed random subset of the valid users (the same every epoch and on every rank)."""
    rows = torch.randperm(len(valid), generator=torch.Generator().manual_seed(config.seed + 7))
    return rows[: config.valid_users] if config.valid_users else rows


def _format_epoch(r: dict) -> str:
    heads = "".join(
        f" | {p[:-1]} hr@10 {r[p + 'hr@10']:.4f}"
        for p in ("parallel_", "long_id_", "draft_", "item_")
        if p + "hr@10" in r
    )
    # The code levels' summed CE: the backbone's training NLL per next item, whatever the heads;
    # with level0_from_items level 0 has no loss of its own (the item objective trains it), so
    # the sum covers levels 1.. only and says so.
    codes = sum(v for k, v in r.items() if k.startswith("train_level_"))
    label = "codes" if "train_level_0" in r else "codes 1+"
    valid = (
        f"valid nll {r['nll']:.4f} hr@10 {r['hr@10']:.4f} ndcg@10 {r['ndcg@10']:.4f}{heads}"
        if "ndcg@10" in r
        else "not validated (train.valid_from)"
    )
    return (
        f"epoch {r['epoch']}: loss {r['train_loss']:.4f} ({label} {codes:.4f}) | {valid} | "
        f"{r['seq_per_s']:.1f} seq/s, {r['epoch_s']:.0f} s"
    )
