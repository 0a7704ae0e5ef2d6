"""The main job on the embedded default, MovieLens-100K from the installed data wheel, end to end:

1. `prepare`: split, item-text embeddings, semantic IDs;
2. `train`: the demo recommender (`configs/ml-100k-demo.json`);
3. `batch`: top-K candidates of every user with the lossless `spec_beam` decoder, as parquet;
4. `replay`: `beam` against `spec_beam` on the test split (HR/NDCG/MRR with paired bootstrap
   intervals, latency, list overlap), written as a self-contained HTML report.

The demo model is the default architecture (item objective, tied code levels, every head) on a
shorter history window, trained for a fixed number of epochs with a fixed seed on one thread, so
every run gives the same model and the same metrics. Both decoders search with `BEAM_WIDTH`
beams, and the replay times one user per call: a service's request, the latency speculative
decoding is for (in large batches beam's per-level passes are already shared by many users).

Each step calls the library function behind the CLI command of the same name and prints that
command line and the step's own summary; the demo ends with one summary: the test metrics,
spec_beam's speedup over beam, and the exactness check (spec_beam's lists must equal beam's for
every user).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from genrec_spec.data_pipelines.prepare import PrepareConfig, prepare
from genrec_spec.data_pipelines.prepare import format_summary as format_prepared
from genrec_spec.jobs.batch import format_summary as format_batch
from genrec_spec.jobs.batch import run_batch
from genrec_spec.jobs.batch_chunks import BatchConfig
from genrec_spec.jobs.replay_arms import ReplayConfig, parse_arm
from genrec_spec.jobs.replay_report import FILES, replay_to_folder
from genrec_spec.recsys.errors import RecommendInputError
from genrec_spec.recsys.train_config import load_config
from genrec_spec.recsys.trainer import check_device, train

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "ml-100k-demo.json"
BEAM_WIDTH = 50  # beams of both decoders: K = 10 items out of a wider search
REPLAY_BATCH = 1  # users per decoder call in the replay: per-request latency


def step(arguments: str) -> str:
    """Print the command line a step stands for (the `genrec-spec` command that does the same);
    returns it."""
    command = f"genrec-spec {arguments}"
    print(f"\n$ {command}", flush=True)
    return command


def run_demo(out: Path, k: int = 10, config: Path = CONFIG) -> dict:
    """Run the four steps into `out` (replaced), then print the summary; returns the replay's
    summary (its metrics.json without the command line)."""
    out = Path(out)
    data, ckpt = out / "data", out / "model"
    candidates, report = out / "candidates", out / "replay"
    # Settings checked before minutes of preparing and training (k past the beams' width
    # failed at the batch step)
    if not 1 <= k <= BEAM_WIDTH:
        raise RecommendInputError(
            f"--k {k}: the demo's decoders keep {BEAM_WIDTH} beams", f"use 1 to {BEAM_WIDTH}"
        )
    model_config, train_config = load_config(config, {"train": {"progress": False}})
    check_device(train_config)
    check_demo_folder(out)

    step(f"prepare --dataset ml-100k --out {data} --overwrite")
    print(format_prepared(prepare("ml-100k", data, PrepareConfig(), overwrite=True), data))

    step(f"train --data {data} --out {ckpt} --config {config} --overwrite --no-progress")
    manifest = train(data, ckpt, model_config, train_config, overwrite=True)
    best = manifest["best"]
    print(
        f"best epoch {best['epoch']}: valid hr@10 {best['hr@10']:.4f} ndcg@10 "
        f"{best['ndcg@10']:.4f}; {manifest['wall_time_s']:.0f} s; checkpoint {ckpt}"
    )

    shutil.rmtree(candidates, ignore_errors=True)  # the batch job resumes, never replaces
    step(
        f"batch --ckpt {ckpt} --users all --out {candidates} --k {k} --decoder spec_beam "
        f"--option beam_width={BEAM_WIDTH} --no-progress"
    )
    batch_config = BatchConfig(k=k, decoder="spec_beam", progress=False)
    options = {"beam_width": BEAM_WIDTH}
    print(format_batch(run_batch(ckpt, "all", candidates, batch_config, options=options)))

    arm_a, arm_b = (f"decoder={name},beam_width={BEAM_WIDTH}" for name in ("beam", "spec_beam"))
    command = step(
        f"replay --ckpt {ckpt} --a {arm_a} --b {arm_b} --split test --k {k} "
        f"--batch-size {REPLAY_BATCH} --out {report} --overwrite"
    )
    result = replay_to_folder(
        parse_arm(arm_a, ckpt, "--a"),
        parse_arm(arm_b, ckpt, "--b"),
        ReplayConfig(k=k, batch_size=REPLAY_BATCH),
        report,
        command,
        overwrite=True,
        split="test",
    )
    print("\n".join(result.summary["verdict"]))
    print(f"wrote {', '.join(FILES)} to {report}")

    print("\n" + summary(result.summary, k, report))
    return result.summary


# What each step leaves in a demo folder: its subfolder and a file only that step writes there
STEP_FILES = {
    "data": "manifest.json",
    "model": "manifest.json",
    "candidates": "_manifest.json",
    "replay": "metrics.json",
}


def check_demo_folder(out: Path) -> None:
    """Refuse an `out` the demo must not replace: a file, or a folder holding anything but an
    earlier demo's outputs (its four subfolders, the training's resume state, and the temporary
    names of an interrupted write), before any step runs. The steps then replace their
    subfolders, so what a user keeps there would be lost."""
    if out.exists() and not out.is_dir():
        raise RecommendInputError(f"--out {out} is a file", "pass a folder path for --out")
    if not out.is_dir():
        return
    fix = "pass a new or empty folder for --out, or an earlier demo's"
    ours = (*STEP_FILES, "model.resume.pt")
    for entry in sorted(out.iterdir()):
        name = entry.name
        if name not in ours and not any(name.startswith(f".{n}") for n in ours):
            raise RecommendInputError(
                f"--out {out} holds {name!r}, which no demo step writes: the demo replaces its "
                f"{', '.join(STEP_FILES)} subfolders there",
                fix,
            )
        if name in STEP_FILES and not entry.is_dir():
            raise RecommendInputError(f"{entry} is a file where the demo writes a folder", fix)
        if name in STEP_FILES and any(entry.iterdir()) and not (entry / STEP_FILES[name]).exists():
            raise RecommendInputError(
                f"{entry} is not empty and holds no {STEP_FILES[name]}: not an earlier demo's",
                fix,
            )


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
        f"  spec_beam runs at {speed:.2f}x beam's speed per request "
        f"({'faster' if speed > 1 else 'slower'}; one user per call, {BEAM_WIDTH} beams): "
        f"{arms['B']['target_passes_per_batch']:.1f} sequential passes instead of "
        f"{arms['A']['target_passes_per_batch']:.1f} (docs/results/recsys-speed.md)"
    )
    lines.append(
        f"  exactness: identical top-{k} lists for {100 * identical:.1f}% of users "
        + ("(OK)" if identical == 1.0 else "(FAILED)")
    )
    lines.append(f"  report: {report / 'report.html'}")
    return "\n".join(lines)
