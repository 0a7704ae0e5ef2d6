"""Train a drafter for SmolLM2-135M-Instruct on its own continuations (self-distillation).

Steps: draw prompts from the train split of the corpora (HumanEval, Debian fortunes, the Python
standard library's documented functions; never the benchmark's prompts), continue them
greedily with the target and record its hidden states (cached under
$GENREC_SPEC_CACHE/drafters/selfdistill, reused by every drafter kind and run with the same
prompts and settings), train the drafter with progress and loss, and save
weights.safetensors + manifest.json (target, data key, steps, loss, held-out acceptance and
this command) to --out (default: $GENREC_SPEC_CACHE/drafters/<kind>, where `generate` looks
for it). Then decode with it:

    genrec-spec train-drafter --model smollm2 --kind medusa
    genrec-spec generate --method medusa --prompt "def fib(n):"

Kinds: medusa (heads on the last hidden state), eagle (a one-layer feature drafter; it also reads
the prompts' hidden states, one cached prefill). eagle2 decodes with the eagle drafter (only its
tree differs), so `--kind eagle2` trains that same drafter into the eagle folder. eagle3: the
EAGLE-3 drafter (the feature drafter on a fusion of the target's low, mid and high layers,
trained with training-time test; one target forward per row recomputes those layers). draft: a small
draft model (a few target layers, trained, between the target's own embeddings and LM head; it
also reads the prompts' hidden states) for `generate --method distilled` and, as a transformers
model, `bench llm --methods hf-assist` (`--kind distilled` trains it too). layerskip: an exit
head after the target's first --layers layers (self-speculation; the layers stay the target's).
mtp: DeepSeek-V3-style sequential multi-token-prediction modules, one per draft depth (--depths),
trained teacher-forced on the target's features and continuations (it also reads the prompts'
hidden states).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from genrec_spec.llm.training.pipeline import EAGLE_PROMPTS, KINDS, DrafterJob
from genrec_spec.llm.training.selfdistill import SelfDistillConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = DrafterJob("medusa")
    parser.add_argument("--model", choices=["smollm2"], default=d.model)
    parser.add_argument("--kind", choices=KINDS, required=True)
    parser.add_argument(
        "--out",
        type=Path,
        default=d.out,
        help="folder for weights + manifest (default $GENREC_SPEC_CACHE/drafters/KIND; "
        "eagle2: the eagle folder)",
    )
    parser.add_argument(
        "--prompts",
        default=d.prompts,
        help="comma-separated corpora (humaneval, fortunes, pystdlib: functions of Python's "
        "standard library), NAME:N for N prompts of NAME; their train split is used (default "
        f"{','.join(SelfDistillConfig().sources)}; eagle, eagle2, eagle3: "
        f"{','.join(EAGLE_PROMPTS)})",
    )
    parser.add_argument("--n", type=int, default=d.n, help="prompts per corpus without its own :N")
    parser.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    parser.add_argument("--batch-size", type=int, default=d.batch_size, help="generation")
    add_training_arguments(parser, d)
    parser.add_argument(
        "--seed", type=int, default=d.seed, help="prompt draw, batches, held-out rows"
    )
    parser.add_argument("--threads", type=int, default=d.threads, help="torch CPU threads")
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=d.cache_dir,
        help="self-distillation data cache (default $GENREC_SPEC_CACHE or ~/.cache/genrec_spec)",
    )


def add_training_arguments(parser: argparse.ArgumentParser, d: DrafterJob) -> None:
    """The optimiser's and each kind's own settings."""
    from genrec_spec.llm.training.distill import DistillConfig
    from genrec_spec.llm.training.eagle import EagleConfig
    from genrec_spec.llm.training.layerskip import LayerSkipConfig
    from genrec_spec.llm.training.medusa import MedusaConfig
    from genrec_spec.llm.training.mtp import MTPConfig

    medusa, eagle, mtp = MedusaConfig(), EagleConfig(), MTPConfig()
    distilled, layerskip = DistillConfig(), LayerSkipConfig()
    parser.add_argument(
        "--steps",
        type=int,
        default=d.steps,
        help=f"optimiser steps (default: medusa {medusa.steps}, eagle {eagle.steps}, "
        f"mtp {mtp.steps}, draft {distilled.steps}, layerskip {layerskip.steps})",
    )
    parser.add_argument(
        "--lr",
        type=float,
        default=d.lr,
        help=f"AdamW peak (medusa {medusa.lr}, eagle {eagle.lr}, mtp {mtp.lr}, "
        f"draft {distilled.lr}, layerskip {layerskip.lr})",
    )
    parser.add_argument("--heads", type=int, default=d.heads, help="Medusa heads K")
    parser.add_argument(
        "--batch-positions",
        type=int,
        default=d.batch_positions,
        help="medusa, layerskip: positions per step",
    )
    parser.add_argument(
        "--layers",
        type=int,
        default=d.layers,
        help="layerskip: the target's first layers the draft keeps",
    )
    parser.add_argument(
        "--batch-rows",
        type=int,
        default=d.batch_rows,
        help=f"sequences per step (eagle, eagle3, mtp {eagle.batch_rows}, "
        f"draft {distilled.batch_rows})",
    )
    parser.add_argument(
        "--unroll",
        type=int,
        default=d.unroll,
        help="eagle3: training-time-test steps (the drafter fed its own features)",
    )
    parser.add_argument(
        "--depths", type=int, default=d.depths, help="mtp: sequential modules, one per draft depth"
    )
    parser.add_argument(
        "--init-layers",
        type=layer_list,
        default=d.init_layers,
        help="draft: the target layers its layers start from, comma-separated (default "
        + ",".join(map(str, d.init_layers))
        + ")",
    )
    parser.add_argument(
        "--draft-vocab",
        type=int,
        default=d.draft_vocab,
        help="eagle, eagle3, mtp, layerskip: tokens the draft's LM head keeps, most frequent first "
        "(0 = all)",
    )


def layer_list(text: str) -> tuple[int, ...]:
    return tuple(int(i) for i in text.split(",") if i.strip())


def job_of(args: argparse.Namespace) -> DrafterJob:
    """The parsed options as the library's settings (the option names are its field names)."""
    return DrafterJob(**{f.name: getattr(args, f.name) for f in dataclasses.fields(DrafterJob)})


def run(args: argparse.Namespace) -> int:
    from genrec_spec.llm.training.pipeline import train_drafter

    print(json.dumps(train_drafter(job_of(args)), indent=2))
    return 0
