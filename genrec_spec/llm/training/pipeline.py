"""One drafter trained end to end, as `genrec-spec train-drafter` runs it: the kind's settings
and corpora, the self-distillation data (cached), the training run, and the command line that
rebuilds the folder (recorded in its manifest).

Kinds: medusa, eagle, eagle3, mtp, draft and layerskip train their own drafter; eagle2 decodes
with the eagle drafter and distilled with the draft model, so those two names train that
drafter (``checkpoint.drafter_kind``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from genrec_spec.llm.training.checkpoint import DrafterError, default_folder, drafter_kind
from genrec_spec.llm.training.distill import DistillConfig
from genrec_spec.llm.training.eagle import EagleConfig
from genrec_spec.llm.training.eagle3 import Eagle3Config
from genrec_spec.llm.training.layerskip import LayerSkipConfig
from genrec_spec.llm.training.medusa import MedusaConfig
from genrec_spec.llm.training.mtp import MTPConfig
from genrec_spec.llm.training.selfdistill import SelfDistillConfig

KINDS = ("medusa", "eagle", "eagle2", "eagle3", "mtp", "draft", "distilled", "layerskip")
# Kinds whose default corpora differ from SelfDistillConfig's (HumanEval's 123 train prompts):
# EAGLE's feature drafters gain from more distinct prompts, the other kinds do not
# (docs/results/llm.md).
EAGLE_PROMPTS = ("humaneval:123", "pystdlib:600")
KIND_PROMPTS = {"eagle": EAGLE_PROMPTS, "eagle3": EAGLE_PROMPTS}

DrafterConfig = (
    MedusaConfig | EagleConfig | Eagle3Config | MTPConfig | DistillConfig | LayerSkipConfig
)


@dataclass(frozen=True)
class DrafterJob:
    """The settings of one run; a field left None takes the kind's default."""

    kind: str  # one of KINDS
    model: str = "smollm2"  # the target
    out: Path | None = None  # weights + manifest folder; None: the cache's drafters/<kind>
    prompts: str | None = None  # comma-separated corpora, NAME:N for N prompts; None: the kind's
    n: int = SelfDistillConfig.n  # prompts per corpus without its own :N
    max_new_tokens: int = SelfDistillConfig.max_new_tokens  # continuation length
    batch_size: int = SelfDistillConfig.batch_size  # rows per generate() call
    steps: int | None = None  # optimiser steps
    lr: float | None = None  # AdamW peak
    heads: int = MedusaConfig.num_heads  # medusa: heads K
    batch_positions: int = MedusaConfig.batch_positions  # medusa, layerskip: positions per step
    layers: int = LayerSkipConfig.n_layers  # layerskip: the target's first layers the draft keeps
    batch_rows: int | None = None  # eagle, eagle3, mtp, draft: sequences per step
    unroll: int = Eagle3Config.unroll  # eagle3: training-time-test steps
    depths: int = MTPConfig.depths  # mtp: sequential modules, one per draft depth
    init_layers: tuple[int, ...] = DistillConfig.layers  # draft: target layers it starts from
    draft_vocab: int = EagleConfig.draft_vocab  # tokens the draft's LM head keeps (0 = all)
    seed: int = SelfDistillConfig.seed  # prompt draw, batches, held-out rows
    threads: int = 1  # torch CPU threads
    cache_dir: Path | None = None  # self-distillation data cache; None: the default cache

    def __post_init__(self) -> None:
        """Counts that cannot train (0 steps divided by zero, 0 rows trained on nothing, ...),
        rates that are no rate and an output that is a file, refused before the target loads."""
        counts = ["n", "max_new_tokens", "batch_size", "heads", "batch_positions", "layers"]
        counts += ["unroll", "depths", "threads"]
        counts += [name for name in ("steps", "batch_rows") if getattr(self, name) is not None]
        small = [
            f"--{n.replace('_', '-')} {getattr(self, n)}" for n in counts if getattr(self, n) < 1
        ]
        if small:
            raise DrafterError(f"{', '.join(small)} must be >= 1", "use 1 or more")
        if self.draft_vocab < 0:
            raise DrafterError(
                f"--draft-vocab {self.draft_vocab} must be >= 0",
                "use 0 (every token) or the number of tokens to keep",
            )
        if self.lr is not None and not 0.0 < self.lr < math.inf:
            raise DrafterError(f"--lr {self.lr}", "use a positive learning rate, e.g. 0.001")
        if self.out is not None and Path(self.out).exists() and not Path(self.out).is_dir():
            raise DrafterError(
                f"--out {self.out} is a file", "pass a folder for the weights and manifest"
            )


def prompts_of(job: DrafterJob) -> str:
    """The corpora as given, else the kind's default corpora."""
    default = KIND_PROMPTS.get(drafter_kind(job.kind), SelfDistillConfig().sources)
    return ",".join(default) if job.prompts is None else job.prompts


def drafter_config(job: DrafterJob) -> DrafterConfig:
    """The kind's training settings: its defaults, overridden by the settings given."""
    tuned = {
        name: value for name, value in (("steps", job.steps), ("lr", job.lr)) if value is not None
    }
    rows = {} if job.batch_rows is None else {"batch_rows": job.batch_rows}
    kind, seed = drafter_kind(job.kind), job.seed
    if kind == "medusa":
        return MedusaConfig(
            num_heads=job.heads, batch_positions=job.batch_positions, seed=seed, **tuned
        )
    if kind == "layerskip":
        return LayerSkipConfig(
            n_layers=job.layers,
            batch_positions=job.batch_positions,
            draft_vocab=job.draft_vocab,
            seed=seed,
            **tuned,
        )
    if kind == "draft":
        return DistillConfig(layers=job.init_layers, seed=seed, **rows, **tuned)
    if kind == "eagle3":
        return Eagle3Config(
            unroll=job.unroll, draft_vocab=job.draft_vocab, seed=seed, **rows, **tuned
        )
    if kind == "mtp":
        return MTPConfig(depths=job.depths, draft_vocab=job.draft_vocab, seed=seed, **rows, **tuned)
    return EagleConfig(draft_vocab=job.draft_vocab, seed=seed, **rows, **tuned)


def command_line(job: DrafterJob, config: DrafterConfig) -> str:
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
        f"genrec-spec train-drafter --model {job.model} --kind {job.kind} --out {job.out} "
        f"--prompts {prompts_of(job)} --n {job.n} --max-new-tokens {job.max_new_tokens} "
        f"--batch-size {job.batch_size} --steps {config.steps} --lr {config.lr} {specific} "
        f"--seed {job.seed}"
    )


def train_drafter(job: DrafterJob, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Self-distil the target on the kind's corpora (cached), train the drafter and save it to
    ``job.out`` (default: the cache's ``drafters/<kind>``); returns its folder and held-out
    acceptance. ``log`` receives the progress lines."""
    import torch

    from genrec_spec.llm.training.selfdistill import load_or_distill, train_prompts
    from genrec_spec.models.llm.smollm2 import load_smollm2

    kind = drafter_kind(job.kind)
    if kind != job.kind:
        log(f"{job.kind} decodes with the {kind} drafter: training that one")
    job = replace(job, out=job.out or default_folder(kind))
    torch.set_num_threads(job.threads)
    sources = tuple(s for s in prompts_of(job).split(",") if s)
    data_config = SelfDistillConfig(sources, job.n, job.max_new_tokens, job.batch_size, job.seed)
    model, tokenizer = load_smollm2()
    prompts = train_prompts(tokenizer, data_config)
    data = load_or_distill(
        model,
        prompts,
        data_config.max_new_tokens,
        data_config.batch_size,
        tokenizer.eos_token_id,
        job.cache_dir,
    )
    log(f"self-distillation data {data.key}: {data.rows} rows, {len(data.tokens)} positions")
    config = drafter_config(job)
    extra = {
        "model": job.model,
        "selfdistill": asdict(data_config),
        "command": command_line(job, config),
    }
    manifest = _train(model, prompts, data, config, job, extra, log)
    return {"out": str(job.out), "held_out": manifest["held_out"]}


def _train(
    model: object,
    prompts: list[list[int]],
    data: object,
    config: DrafterConfig,
    job: DrafterJob,
    extra: dict[str, Any],
    log: Callable[[str], None],
) -> dict[str, Any]:
    """The kind's training function on the data; the kinds that read the prompts' own hidden
    states get them (one cached prefill). Returns the saved manifest."""
    from genrec_spec.llm.training.distill import train_distilled
    from genrec_spec.llm.training.eagle import train_eagle
    from genrec_spec.llm.training.eagle3 import train_eagle3
    from genrec_spec.llm.training.layerskip import train_layerskip
    from genrec_spec.llm.training.medusa import train_medusa
    from genrec_spec.llm.training.mtp import train_mtp
    from genrec_spec.llm.training.selfdistill import load_or_prefill

    if isinstance(config, MedusaConfig):
        return train_medusa(model, data, config, job.out, extra)
    if isinstance(config, LayerSkipConfig):
        return train_layerskip(model, prompts, data, config, job.out, extra)
    context = load_or_prefill(model, prompts, job.batch_size, job.cache_dir)
    log(f"prompt pairs {context.key}: {len(context.tokens)} positions")
    if isinstance(config, DistillConfig):
        return train_distilled(model, data, context, prompts, config, job.out, extra)
    if isinstance(config, Eagle3Config):
        return train_eagle3(model, data, context, prompts, config, job.out, extra)
    if isinstance(config, MTPConfig):
        return train_mtp(model, data, context, config, job.out, extra)
    return train_eagle(model, data, context, config, job.out, extra)
