"""Train a drafter for SmolLM2-135M-Instruct on its own continuations (self-distillation).

Steps: draw prompts from the train split of the corpora (HumanEval, Debian fortunes; never the
benchmark's prompts), continue them greedily with the target and record its hidden states
(cached under $GENREC_SPEC_CACHE/drafters/selfdistill, reused by every drafter kind and run
with the same prompts and settings), train the drafter with progress and loss, and save
weights.safetensors + manifest.json (target, data key, steps, loss, held-out acceptance and
this command) to --out (default: $GENREC_SPEC_CACHE/drafters/<kind>, where `generate` looks
for it). Then decode with it:

    genrec-spec train-drafter --model smollm2 --kind medusa
    genrec-spec generate --method medusa --prompt "def fib(n):"
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from genrec_spec.drafters.medusa import MedusaConfig
from genrec_spec.drafters.selfdistill import SelfDistillConfig

KINDS = ("medusa",)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    data, medusa = SelfDistillConfig(), MedusaConfig()
    parser.add_argument("--model", choices=["smollm2"], default="smollm2")
    parser.add_argument("--kind", choices=KINDS, required=True)
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="folder for weights + manifest (default $GENREC_SPEC_CACHE/drafters/KIND)",
    )
    parser.add_argument(
        "--prompts",
        default=",".join(data.sources),
        help="comma-separated corpora (humaneval, fortunes); their train split is used",
    )
    parser.add_argument("--n", type=int, default=data.n, help="prompts per corpus")
    parser.add_argument("--max-new-tokens", type=int, default=data.max_new_tokens)
    parser.add_argument("--batch-size", type=int, default=data.batch_size, help="generation")
    parser.add_argument("--steps", type=int, default=medusa.steps)
    parser.add_argument("--heads", type=int, default=medusa.num_heads, help="Medusa heads K")
    parser.add_argument("--batch-positions", type=int, default=medusa.batch_positions)
    parser.add_argument("--lr", type=float, default=medusa.lr)
    parser.add_argument(
        "--seed", type=int, default=data.seed, help="prompt draw, batches, held-out rows"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="self-distillation data cache (default $GENREC_SPEC_CACHE or ~/.cache/genrec_spec)",
    )


def command_line(args: argparse.Namespace) -> str:
    """The full command that rebuilds this drafter (every setting spelled out)."""
    return (
        f"genrec-spec train-drafter --model {args.model} --kind {args.kind} --out {args.out} "
        f"--prompts {args.prompts} --n {args.n} --max-new-tokens {args.max_new_tokens} "
        f"--batch-size {args.batch_size} --steps {args.steps} --heads {args.heads} "
        f"--batch-positions {args.batch_positions} --lr {args.lr} --seed {args.seed}"
    )


def run(args: argparse.Namespace) -> int:
    import torch

    from genrec_spec.drafters.checkpoint import default_folder
    from genrec_spec.drafters.medusa import train_medusa
    from genrec_spec.drafters.selfdistill import load_or_distill, train_prompts
    from genrec_spec.models.smollm2 import load_smollm2

    args.out = args.out or default_folder(args.kind)
    torch.set_num_threads(args.threads)
    sources = tuple(s for s in args.prompts.split(",") if s)
    data_config = SelfDistillConfig(
        sources, args.n, args.max_new_tokens, args.batch_size, args.seed
    )
    model, tokenizer = load_smollm2()
    prompts = train_prompts(tokenizer, data_config)
    data = load_or_distill(
        model,
        prompts,
        data_config.max_new_tokens,
        data_config.batch_size,
        tokenizer.eos_token_id,
        args.cache_dir,
    )
    print(f"self-distillation data {data.key}: {data.rows} rows, {len(data.tokens)} positions")
    config = MedusaConfig(
        num_heads=args.heads,
        steps=args.steps,
        batch_positions=args.batch_positions,
        lr=args.lr,
        seed=args.seed,
    )
    extra = {"model": args.model, "selfdistill": asdict(data_config), "command": command_line(args)}
    manifest = train_medusa(model, data, config, args.out, extra)
    print(json.dumps({"out": str(args.out), "held_out": manifest["held_out"]}, indent=2))
    return 0
