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
import json
from dataclasses import asdict
from pathlib import Path

from genrec_spec.llm.training.checkpoint import drafter_kind
from genrec_spec.llm.training.distill import DistillConfig
from genrec_spec.llm.training.eagle import EagleConfig
from genrec_spec.llm.training.eagle3 import Eagle3Config
from genrec_spec.llm.training.layerskip import LayerSkipConfig
from genrec_spec.llm.training.medusa import MedusaConfig
from genrec_spec.llm.training.mtp import MTPConfig
from genrec_spec.llm.training.selfdistill import SelfDistillConfig

KINDS = ("medusa", "eagle", "eagle2", "eagle3", "mtp", "draft", "distilled", "layerskip")
# Kinds whose default corpora differ from SelfDistillConfig's (HumanEval's 123 train prompts).
# EAGLE's feature drafters gain from more distinct prompts: on SmolLM2, held-out HumanEval,
# greedy, every step drafting its full tree, EAGLE's accepted length rose 2.02 -> 2.23 (EAGLE-2's
# 12-node tree) and 2.37 -> 2.67 (a 60-node tree) with 600 of the standard library's functions
# added at 800 steps (1,400 of them: 2.29 / 2.70); EAGLE-3's 2.07 / 2.48 (HumanEval alone, 200
# steps) -> 2.24 / 2.66 at 800 steps (1,400 functions: 2.26 / 2.74). The other drafters at
# their default budgets held (MTP 1.65 / 1.64, layer skip 1.63 / 1.64) or lost (Medusa 2.02 /
# 1.98 at 1,000 steps, the draft model 1.69 / 1.62, its default steps passing over the 723
# rows 1.3 times).
EAGLE_PROMPTS = ("humaneval:123", "pystdlib:600")
KIND_PROMPTS = {"eagle": EAGLE_PROMPTS, "eagle3": EAGLE_PROMPTS}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    data, medusa, eagle = SelfDistillConfig(), MedusaConfig(), EagleConfig()
    distilled = DistillConfig()
    layerskip, mtp = LayerSkipConfig(), MTPConfig()
    parser.add_argument("--model", choices=["smollm2"], default="smollm2")
    parser.add_argument("--kind", choices=KINDS, required=True)
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="folder for weights + manifest (default $GENREC_SPEC_CACHE/drafters/KIND; "
        "eagle2: the eagle folder)",
    )
    parser.add_argument(
        "--prompts",
        default=None,
        help="comma-separated corpora (humaneval, fortunes, pystdlib: functions of Python's "
        "standard library), NAME:N for N prompts of NAME; their train split is used (default "
        f"{','.join(data.sources)}; eagle, eagle2, eagle3: {','.join(EAGLE_PROMPTS)})",
    )
    parser.add_argument(
        "--n", type=int, default=data.n, help="prompts per corpus without its own :N"
    )
    parser.add_argument("--max-new-tokens", type=int, default=data.max_new_tokens)
    parser.add_argument("--batch-size", type=int, default=data.batch_size, help="generation")
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help=f"optimiser steps (default: medusa {medusa.steps}, eagle {eagle.steps}, "
        f"mtp {mtp.steps}, draft {distilled.steps}, layerskip {layerskip.steps})",
    )
    parser.add_argument(
        "--lr",
        type=float,
        default=None,
        help=f"AdamW peak (medusa {medusa.lr}, eagle {eagle.lr}, mtp {mtp.lr}, "
        f"draft {distilled.lr}, layerskip {layerskip.lr})",
    )
    parser.add_argument("--heads", type=int, default=medusa.num_heads, help="Medusa heads K")
    parser.add_argument(
        "--batch-positions",
        type=int,
        default=medusa.batch_positions,
        help="medusa, layerskip: positions per step",
    )
    parser.add_argument(
        "--layers",
        type=int,
        default=layerskip.n_layers,
        help="layerskip: the target's first layers the draft keeps",
    )
    parser.add_argument(
        "--batch-rows",
        type=int,
        default=None,
        help=f"sequences per step (eagle, eagle3, mtp {eagle.batch_rows}, "
        f"draft {distilled.batch_rows})",
    )
    parser.add_argument(
        "--unroll",
        type=int,
        default=Eagle3Config().unroll,
        help="eagle3: training-time-test steps (the drafter fed its own features)",
    )
    parser.add_argument(
        "--depths",
        type=int,
        default=mtp.depths,
        help="mtp: sequential modules, one per draft depth",
    )
    parser.add_argument(
        "--init-layers",
        type=layer_list,
        default=distilled.layers,
        help="draft: the target layers its layers start from, comma-separated (default "
        + ",".join(map(str, distilled.layers))
        + ")",
    )
    parser.add_argument(
        "--draft-vocab",
        type=int,
        default=eagle.draft_vocab,
        help="eagle, eagle3, mtp, layerskip: tokens the draft's LM head keeps, most frequent first "
        "(0 = all)",
    )
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


def prompts_of(args: argparse.Namespace) -> str:
    """--prompts as given, else the kind's default corpora."""
    default = KIND_PROMPTS.get(drafter_kind(args.kind), SelfDistillConfig().sources)
    return ",".join(default) if args.prompts is None else args.prompts


def layer_list(text: str) -> tuple[int, ...]:
    return tuple(int(i) for i in text.split(",") if i.strip())


def drafter_config(
    args: argparse.Namespace,
) -> MedusaConfig | EagleConfig | Eagle3Config | MTPConfig | DistillConfig | LayerSkipConfig:
    """The kind's training settings: its defaults, overridden by the flags given."""
    tuned = {
        name: value for name, value in (("steps", args.steps), ("lr", args.lr)) if value is not None
    }
    rows = {} if args.batch_rows is None else {"batch_rows": args.batch_rows}
    if drafter_kind(args.kind) == "medusa":
        return MedusaConfig(
            num_heads=args.heads, batch_positions=args.batch_positions, seed=args.seed, **tuned
        )
    if args.kind == "layerskip":
        return LayerSkipConfig(
            n_layers=args.layers,
            batch_positions=args.batch_positions,
            draft_vocab=args.draft_vocab,
            seed=args.seed,
            **tuned,
        )
    if drafter_kind(args.kind) == "draft":
        return DistillConfig(layers=args.init_layers, seed=args.seed, **rows, **tuned)
    if args.kind == "eagle3":
        return Eagle3Config(
            unroll=args.unroll, draft_vocab=args.draft_vocab, seed=args.seed, **rows, **tuned
        )
    if args.kind == "mtp":
        return MTPConfig(
            depths=args.depths, draft_vocab=args.draft_vocab, seed=args.seed, **rows, **tuned
        )
    return EagleConfig(draft_vocab=args.draft_vocab, seed=args.seed, **rows, **tuned)


def command_line(
    args: argparse.Namespace,
    config: MedusaConfig | EagleConfig | Eagle3Config | MTPConfig | DistillConfig | LayerSkipConfig,
) -> str:
    """The full command that rebuilds this drafter (every setting spelled out)."""
    if isinstance(config, MedusaConfig):
        specific = f"--heads {config.num_heads} --batch-positions {config.batch_positions}"
    elif isinstance(config, LayerSkipConfig):
        specific = (
            f"--layers {config.n_layers} --batch-positions {config.batch_positions} "
            f"--draft-vocab {config.draft_vocab}"
        )
    elif isinstance(config, DistillConfig):
        layers = ",".join(map(str, config.layers))
        specific = f"--batch-rows {config.batch_rows} --init-layers {layers}"
    elif isinstance(config, Eagle3Config):
        specific = (
            f"--batch-rows {config.batch_rows} --unroll {config.unroll} "
            f"--draft-vocab {config.draft_vocab}"
        )
    elif isinstance(config, MTPConfig):
        specific = (
            f"--batch-rows {config.batch_rows} --depths {config.depths} "
            f"--draft-vocab {config.draft_vocab}"
        )
    else:
        specific = f"--batch-rows {config.batch_rows} --draft-vocab {config.draft_vocab}"
    return (
        f"genrec-spec train-drafter --model {args.model} --kind {args.kind} --out {args.out} "
        f"--prompts {prompts_of(args)} --n {args.n} --max-new-tokens {args.max_new_tokens} "
        f"--batch-size {args.batch_size} --steps {config.steps} --lr {config.lr} {specific} "
        f"--seed {args.seed}"
    )


def run(args: argparse.Namespace) -> int:
    import torch

    from genrec_spec.llm.training.checkpoint import default_folder
    from genrec_spec.llm.training.distill import train_distilled
    from genrec_spec.llm.training.eagle import train_eagle
    from genrec_spec.llm.training.eagle3 import train_eagle3
    from genrec_spec.llm.training.layerskip import train_layerskip
    from genrec_spec.llm.training.medusa import train_medusa
    from genrec_spec.llm.training.mtp import train_mtp
    from genrec_spec.llm.training.selfdistill import load_or_distill, load_or_prefill, train_prompts
    from genrec_spec.models.llm.smollm2 import load_smollm2

    kind = drafter_kind(args.kind)
    if kind != args.kind:
        print(f"{args.kind} decodes with the {kind} drafter: training that one")
    args.out = args.out or default_folder(kind)
    torch.set_num_threads(args.threads)
    sources = tuple(s for s in prompts_of(args).split(",") if s)
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
    config = drafter_config(args)
    extra = {
        "model": args.model,
        "selfdistill": asdict(data_config),
        "command": command_line(args, config),
    }
    if isinstance(config, MedusaConfig):
        manifest = train_medusa(model, data, config, args.out, extra)
    elif isinstance(config, LayerSkipConfig):
        manifest = train_layerskip(model, prompts, data, config, args.out, extra)
    else:
        context = load_or_prefill(model, prompts, data_config.batch_size, args.cache_dir)
        print(f"prompt pairs {context.key}: {len(context.tokens)} positions")
        if isinstance(config, DistillConfig):
            manifest = train_distilled(model, data, context, prompts, config, args.out, extra)
        elif isinstance(config, Eagle3Config):
            manifest = train_eagle3(model, data, context, prompts, config, args.out, extra)
        elif isinstance(config, MTPConfig):
            manifest = train_mtp(model, data, context, config, args.out, extra)
        else:
            manifest = train_eagle(model, data, context, config, args.out, extra)
    print(json.dumps({"out": str(args.out), "held_out": manifest["held_out"]}, indent=2))
    return 0
