"""The main job on the embedded default, MovieLens-100K from the installed data wheel, end to end:

1. `prepare`: split, item-text embeddings, semantic IDs;
2. `train`: the demo recommender (`configs/ml-100k-demo.json`, ~3 minutes on 2 cores);
3. `batch`: top-K candidates of every user with the lossless `spec_beam` decoder, as parquet;
4. `replay`: `beam` against `spec_beam` on the test split (HR/NDCG/MRR with paired bootstrap
   intervals, latency, list overlap), written as a self-contained HTML report.

Each step is the CLI command of the same name (its own summary is printed as it runs); the demo
ends with one summary: the test metrics, spec_beam's speedup over beam, and the exactness check
(spec_beam's lists must equal beam's for every user).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "ml-100k-demo.json"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--out", type=Path, default=Path("runs/demo"), help="demo output folder (replaced)"
    )
    parser.add_argument("--k", type=int, default=10, help="list length and metric cut-off")
    parser.add_argument(
        "--config", type=Path, default=CONFIG, help="training config (default: the demo's)"
    )


def run(args: argparse.Namespace) -> int:
    from genrec_spec.cli import main

    data, ckpt = args.out / "data", args.out / "model"
    batch, report = args.out / "candidates", args.out / "replay"
    steps = [
        ["prepare", "--dataset", "ml-100k", "--out", str(data), "--overwrite"],
        ["train", "--data", str(data), "--out", str(ckpt), "--config", str(args.config)]
        + ["--overwrite", "--no-progress"],
        ["batch", "--ckpt", str(ckpt), "--users", "all", "--out", str(batch)]
        + ["--k", str(args.k), "--decoder", "spec_beam", "--no-progress"],
        ["replay", "--ckpt", str(ckpt), "--a", "decoder=beam", "--b", "decoder=spec_beam"]
        + ["--split", "test", "--k", str(args.k), "--out", str(report), "--overwrite"],
    ]
    shutil.rmtree(batch, ignore_errors=True)  # the batch job resumes, never replaces: start anew
    for step in steps:
        print(f"\n$ genrec-spec {' '.join(step)}", flush=True)
        code = main(step)
        if code:
            return code
    metrics = json.loads((report / "metrics.json").read_text())
    print("\n" + summary(metrics, args.k, report))
    return 0


def summary(metrics: dict, k: int, report: Path) -> str:
    """The demo's closing lines from the replay's metrics.json."""
    arms, latency, overlap = metrics["arms"], metrics["latency"], metrics["overlap"]
    lines = ["demo summary (MovieLens-100K, test split, full catalogue):"]
    for name, arm in (("beam", arms["A"]), ("spec_beam", arms["B"])):
        m = arm["metrics"]
        lines.append(
            f"  {name:<9} HR@{k} {m[f'hr@{k}']:.4f}  NDCG@{k} {m[f'ndcg@{k}']:.4f}  "
            f"MRR@{k} {m[f'mrr@{k}']:.4f}  {arm['ms_per_event']:.2f} ms/user"
        )
    identical = overlap["identical_lists"]
    speed = latency["speedup_of_b"]
    lines.append(
        f"  spec_beam runs at {speed:.2f}x beam's speed ({'faster' if speed > 1 else 'slower'}): "
        f"{arms['B']['target_passes_per_batch']:.1f} sequential passes instead of "
        f"{arms['A']['target_passes_per_batch']:.1f}, but more tree nodes per pass (README: "
        f"where that pays)"
    )
    lines.append(
        f"  exactness: identical top-{k} lists for {100 * identical:.1f}% of users "
        + ("(OK)" if identical == 1.0 else "(FAILED)")
    )
    lines.append(f"  report: {report / 'report.html'}")
    return "\n".join(lines)
