"""The main job on the embedded default: MovieLens-100K from the installed data wheel through the
data pipeline (split, item embeddings, semantic IDs), printing its summary. Later stages (train,
batch candidate generation, replay) are added to this same command as they land."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--out", type=Path, default=Path("runs/demo"), help="demo output folder (replaced)"
    )


def run(args: argparse.Namespace) -> int:
    from genrec_spec.data_pipelines.prepare import PrepareConfig, format_summary, prepare

    data_dir = args.out / "data"
    manifest = prepare("ml-100k", data_dir, PrepareConfig(), overwrite=True)
    print(format_summary(manifest, data_dir))
    return 0
