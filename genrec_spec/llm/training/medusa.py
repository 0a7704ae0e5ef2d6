"""Training Medusa heads on self-distillation data, and loading them back.

Head k (k = 1..K) learns ``hidden[j] -> tokens[j + k]`` within a row of the data (see
``selfdistill``: the target's own greedy continuations), with cross-entropy through the target's
frozen LM head; only the residual blocks train (``training.fit``: AdamW, warm-up then cosine
decay). A share of the rows (whole prompts) is held out; the manifest reports each head's top-1
accuracy there and the chain acceptance per depth k (heads 1..k all right: how often a one-path
tree of top tokens is accepted to depth k under greedy decoding).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from genrec_spec.llm.training.checkpoint import (
    DrafterError,
    load_drafter,
    output_weight,
    save_drafter,
)
from genrec_spec.llm.training.loop import drafter_manifest, fit, held_out_rows
from genrec_spec.llm.training.selfdistill import SelfDistillData
from genrec_spec.models.llm.medusa_heads import MedusaHeads

KIND = "medusa"
IGNORE = -100  # label of a head whose target token lies past the row's end


@dataclass(frozen=True)
class MedusaConfig:
    """Defaults of Medusa training."""

    num_heads: int = 3  # K: head k predicts the token k places past the target's next token
    steps: int = 300  # optimiser steps
    batch_positions: int = 256  # hidden states per step
    lr: float = 1e-3  # AdamW peak learning rate (Medusa-1's)
    weight_decay: float = 0.0
    warmup: int = 20  # linear warm-up steps, then cosine decay to 0
    held_out: float = 0.1  # share of rows (prompts) kept out of training for the manifest
    seed: int = 0  # batch draws and held-out rows
    log_every: int = 50  # print the running loss every this many steps


def head_labels(
    tokens: Tensor,  # [S] int64, self-distillation tokens
    offsets: Tensor,  # [R + 1] int64, row boundaries
    num_heads: int,  # K
) -> Tensor:  # [S, K] int64
    """Head k's label at position j: tokens[j + k] when j + k is in j's row, else IGNORE."""
    ends = torch.repeat_interleave(offsets[1:], offsets.diff())  # [S] row end of each position
    ahead = torch.arange(len(tokens))[:, None] + torch.arange(1, num_heads + 1)  # [S, K]
    return torch.where(ahead < ends[:, None], tokens[ahead.clamp_max(len(tokens) - 1)], IGNORE)


def split_positions(
    offsets: Tensor,  # [R + 1] int64, row boundaries
    held_out: float,
    seed: int,
) -> tuple[Tensor, Tensor]:  # [P_train], [P_held] int64 positions
    """Positions of the training rows and of the held-out rows (``training.held_out_rows``)."""
    held = held_out_rows(len(offsets) - 1, held_out, seed)
    per_position = torch.repeat_interleave(held, offsets.diff())  # [S]
    return (~per_position).nonzero().squeeze(1), per_position.nonzero().squeeze(1)


def _loss_backward(
    heads: MedusaHeads,
    hidden: Tensor,  # [P, D]
    labels: Tensor,  # [P, K] int64, IGNORE where absent
) -> Tensor:  # [] the mean over heads of their cross-entropy
    """The loss, with its gradient accumulated into the heads. One head's [P, V] logits live at
    a time: the gradient stops at the blocks' outputs, each head's loss backpropagates there,
    then once through the blocks."""
    features = heads.features(hidden[None])[0]  # [P, K, D]
    leaf = features.detach().requires_grad_()
    total = hidden.new_zeros(())
    for k in range(heads.num_heads):
        loss = _head_loss(heads, leaf[:, k], labels[:, k]) / heads.num_heads
        loss.backward()
        total += loss.detach()
    features.backward(leaf.grad)
    return total


def _head_loss(
    heads: MedusaHeads,
    features: Tensor,  # [P, D] one head's block outputs
    labels: Tensor,  # [P] int64, IGNORE where absent
) -> Tensor:  # [] mean cross-entropy through the LM head over the labelled positions
    logits = F.linear(features, heads.lm_head)  # [P, V]
    total = F.cross_entropy(logits, labels, ignore_index=IGNORE, reduction="sum")
    return total / (labels != IGNORE).sum().clamp_min(1)


@torch.no_grad()
def evaluate(
    heads: MedusaHeads,
    hidden: Tensor,  # [P, D]
    labels: Tensor,  # [P, K] int64, IGNORE where absent
    chunk: int = 64,  # positions per forward ([chunk, K, V] logits at a time)
) -> dict[str, Any]:
    """Mean loss, top-1 accuracy per head and chain acceptance per depth k (heads 1..k all
    right), each over the positions where head k has a label."""
    correct, losses, counts = [], torch.zeros(heads.num_heads), torch.zeros(heads.num_heads)
    for start in range(0, len(hidden), chunk):
        logits = heads(hidden[start : start + chunk][None])[0]  # [P, K, V]
        target = labels[start : start + chunk]  # [P, K]
        keep = target != IGNORE
        nll = F.cross_entropy(
            logits.transpose(1, 2), target, ignore_index=IGNORE, reduction="none"
        )  # [P, K]
        losses += nll.sum(0)
        counts += keep.sum(0)
        correct.append(torch.where(keep, logits.argmax(-1) == target, False))
    right = torch.cat(correct).float()  # [P, K]
    chain = right.cumprod(1)  # all heads up to k right
    return {
        "loss": float(losses.sum() / counts.sum().clamp_min(1)),
        "top1": (right.sum(0) / counts.clamp_min(1)).tolist(),
        "chain": (chain.sum(0) / counts.clamp_min(1)).tolist(),
        "positions": int(counts[0]),
    }


def train_medusa(
    model: Any,
    data: SelfDistillData,
    config: MedusaConfig,
    out: Path,
    extra_manifest: dict[str, Any] | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Train K heads for the native Llama ``model`` on ``data``, save them (weights + manifest)
    to ``out`` and return the manifest. ``extra_manifest`` adds entries (the CLI's command)."""
    heads = MedusaHeads(output_weight(model).float(), config.num_heads)
    labels = head_labels(data.tokens, data.offsets, config.num_heads)  # [S, K]
    train, held = split_positions(data.offsets, config.held_out, config.seed)
    train = train[labels[train, 0] != IGNORE]  # a row's last position teaches no head
    if len(train) == 0:
        raise DrafterError(
            "the self-distillation data has no training position with a label for head 1",
            "generate more or longer continuations (--n, --max-new-tokens >= 2)",
        )
    generator = torch.Generator().manual_seed(config.seed)

    def step() -> float:
        pick = train[torch.randint(len(train), (config.batch_positions,), generator=generator)]
        return float(_loss_backward(heads, data.hidden[pick], labels[pick]))

    train_loss = fit(heads.parameters(), step, config, desc=KIND, progress=progress)
    held_out = evaluate(heads, data.hidden[held], labels[held]) if len(held) else None
    manifest = drafter_manifest(KIND, model, data, config, train_loss, held_out, extra_manifest)
    return save_drafter(out, dict(heads.state_dict()), manifest)


def load_medusa(
    folder: Path, model: Any, model_name: str = "smollm2"
) -> tuple[MedusaHeads, dict[str, Any]]:
    """Heads saved by ``train_medusa`` for ``model``, in the model's dtype, and the manifest."""
    tensors, manifest = load_drafter(folder, KIND, model, model_name)
    lm_head = output_weight(model)
    heads = MedusaHeads(lm_head, tensors["weight"].shape[0])
    heads.load_state_dict({name: t.to(lm_head.dtype) for name, t in tensors.items()})
    return heads.eval(), manifest
