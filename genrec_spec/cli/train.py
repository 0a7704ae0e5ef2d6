"""Train the Semantic-ID generative recommender on a prepared data folder.

    genrec-spec train --data DIR --out CKPT [--config configs/ml-1m.json]

The config file is JSON with two optional sections, {"model": {...}, "train": {...}}, whose
keys are the fields of `RecommenderConfig` (models/recsys/config.py) and `TrainConfig`
(recsys/train_config.py); missing keys keep their defaults. Each epoch
reports the training losses and validation HR@10 / NDCG@10 on a fixed subset of valid users,
ranked by the model's exact trie-constrained log-likelihood of every catalogue item
(`models/recsys/item_scores.py`: what an unboundedly wide trie-constrained beam search would
return) and their NLL of the targets; training stops when NDCG@10 has not improved for
`patience` epochs, or when the next epoch would end past `max_minutes`, and the checkpoint keeps
the best epoch's weights. The learning rate's cosine decay spans the epochs that fit in
`max_minutes` (re-planned after every epoch at the last epoch's speed), so a run cut by the time
budget still ends annealed.

Under `torchrun --nproc_per_node N` the same command trains with DistributedDataParallel (gloo on
CPU, NCCL on GPU); `batch_size` stays the global batch, so the optimisation matches one process.

After every epoch the run leaves its resume state in `CKPT.resume.pt` beside the checkpoint
folder (removed once the checkpoint is written). If the run is killed, the same command with
`--resume` continues after the last completed epoch and writes the checkpoint the uninterrupted
run would have written; with no resume state there it starts afresh, so a restart loop can always
pass it:

    until genrec-spec train --data DIR --out CKPT --config C --resume; do sleep 10; done

A resume state is only continued on request: without `--resume` the command refuses to start
over it (`--overwrite` starts over and discards it), and it refuses one left by another config,
data or number of processes. The checkpoint's manifest lists the epochs the run resumed after.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", required=True, type=Path, help="folder from genrec-spec prepare")
    parser.add_argument("--out", required=True, type=Path, help="checkpoint folder (created)")
    parser.add_argument("--config", type=Path, default=None, help="JSON config (configs/*.json)")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing --out; without --resume, start over an interrupted run",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue the interrupted run whose resume state is beside --out (if there is one)",
    )
    parser.add_argument("--epochs", type=int, default=None, help="override train.epochs")
    parser.add_argument("--device", default=None, help="override train.device (auto|cpu|cuda)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def run(args: argparse.Namespace) -> int:
    from genrec_spec.recsys.train_config import load_config
    from genrec_spec.recsys.trainer import train

    overrides: dict = {"train": {}}
    if args.epochs is not None:
        overrides["train"]["epochs"] = args.epochs
    if args.device is not None:
        overrides["train"]["device"] = args.device
    if args.no_progress:
        overrides["train"]["progress"] = False
    model_config, train_config = load_config(args.config, overrides)
    manifest = train(
        args.data,
        args.out,
        model_config,
        train_config,
        overwrite=args.overwrite,
        resume=args.resume,
    )
    if manifest is not None:  # rank 0 only
        best = manifest["best"]
        print(
            f"best epoch {best['epoch']}: valid hr@10 {best['hr@10']:.4f} ndcg@10 "
            f"{best['ndcg@10']:.4f}; {manifest['wall_time_s']:.0f} s; checkpoint {args.out}"
        )
    return 0
