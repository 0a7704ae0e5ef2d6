"""Training DeepSeek-V3-style sequential MTP modules (``models.llm.mtp_drafter``) on
self-distillation data, and loading them back.

Data: EAGLE's sequences (``eagle.Sequences``): a row's prompt pairs, then its continuation pairs,
pair i = (f_i, x_{i+1}) with f_i the target's final-normed feature; rows keep their last
``max_pairs`` pairs (the continuation and the prompt's end; ``Sequences``).

Teacher forcing (DeepSeek-V3's training): module k at position i reads the previous depth's
state h^{k-1}_i and the true token x_{i+k}, and learns x_{i+k+1}, the target's own greedy token,
wherever that token lies in the continuation (the prompt is context). The loss is the mean over
the K depths of each depth's cross-entropy over the draft vocabulary (``eagle.token_loss``); the
target stays frozen and the K modules train jointly. (DeepSeek-V3 adds the MTP loss, weighted,
to its main model's; with the target frozen only this mean is left.) No feature regression and
no input noise. AdamW with warm-up and cosine decay (``training.fit``).

Held-out rows: the loss per depth; the chain acceptance per depth k: from every continuation
position, the top tokens of depths 1 .. k all right (how a one-path draft fares under greedy
decoding). Teacher forcing gives it without a rollout: while a chain is right, every module of
the draft read the true tokens, so its states are the teacher-forced ones. And the rank shares
per depth (how often the true token is depth k's r-th choice, its prefix right), which shape a
static tree.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from genrec_spec.llm.training.checkpoint import output_weight
from genrec_spec.llm.training.eagle import (
    RANKS,
    FeatureTraining,
    Sequences,
    load_feature_drafter,
    rank_counts,
    token_loss,
)
from genrec_spec.llm.training.selfdistill import SelfDistillData
from genrec_spec.models.llm.mtp_drafter import MTPDrafter

KIND = "mtp"


@dataclass(frozen=True)
class MTPConfig:
    """Defaults of MTP drafter training."""

    # Optimiser steps: held-out chain acceptance stops growing past this while the held-out
    # loss rises (the modules memorise the training rows).
    steps: int = 200
    batch_rows: int = 8  # sequences (prompt + continuation pairs) per step
    lr: float = 1e-3  # AdamW peak learning rate
    weight_decay: float = 0.0
    warmup: int = 20  # linear warm-up steps, then cosine decay to 0
    depths: int = 4  # K sequential modules: drafts up to K tokens past the root
    max_pairs: int = 192  # rows keep their last max_pairs pairs (SmolLM2: continuations <= 128)
    draft_vocab: int = 8192  # tokens the shared LM head keeps (most frequent); 0 = all
    held_out: float = 0.1  # share of rows (prompts) kept out of training for the manifest
    seed: int = 0  # initialisation, batch draws and held-out rows
    log_every: int = 50  # print the running loss every this many steps


class MTPTraining(FeatureTraining):
    """``FeatureTraining`` of an MTP drafter with ``config.depths`` modules."""

    def new_drafter(self, vocab_ids: Tensor | None) -> MTPDrafter:  # vocab_ids [V'] or None
        model = self.model
        return MTPDrafter(
            model.config,
            model.tok_embeddings.weight.float(),
            output_weight(model).float(),
            self.config.depths,
            vocab_ids,
        )


def depth_losses(
    drafter: MTPDrafter,
    features: Tensor,  # [R, T, D] the target's features of the pairs
    tokens: Tensor,  # [R, T] int64 the pairs' tokens x_{i+1}
    mask: Tensor,  # [R, T - 1] bool: pair i learns pair i + 1 (``Sequences.batch``)
) -> list[Tensor]:  # cross-entropy [] per depth 1 .. K
    """Depth k's state at position i drafts x_{i+k+1} = tokens[i + k], learnt where pair i + k
    is a continuation pair (mask[:, i + k - 1])."""
    losses = []
    for k, states in enumerate(drafter.teacher_forced(features, tokens), 1):
        learnt = mask[:, k - 1 :]  # [R, T - k]
        losses.append(token_loss(drafter, states[:, :-1][learnt], tokens[:, k:][learnt]))
    return losses


@torch.no_grad()
def evaluate(drafter: MTPDrafter, sequences: Sequences, rows: list[int]) -> dict[str, Any]:
    """Held-out loss per depth, chain acceptance per depth and rank shares per depth (module
    docstring); ``chain``, ``top1`` and ``ranks`` (depth 1's) as ``eagle.evaluate`` names them."""
    depths = drafter.depths
    loss_sums, weights = torch.zeros(depths), torch.zeros(depths)
    hits, counts, ranked = torch.zeros(depths), torch.zeros(depths), torch.zeros(depths, RANKS)
    for r in rows:
        features, tokens, mask = sequences.batch([r])  # [1, T, D], [1, T], [1, T - 1]
        length = tokens.shape[1]
        alive = torch.ones(length - 1, dtype=torch.bool)  # [T - 1] chains from each position
        for k, states in enumerate(drafter.teacher_forced(features, tokens), 1):
            drafted, labels = states[0, :-1], tokens[0, k:]  # [T - k, D], [T - k]
            counted = mask[0, : length - k]  # [T - k] chains that start in the continuation
            loss = token_loss(drafter, drafted[counted], labels[counted])
            loss_sums[k - 1] += loss * counted.sum()
            weights[k - 1] += counted.sum()
            guess = drafter.vocab_ids[drafter.logits(drafted).argmax(-1)]  # [T - k]
            alive = alive[: length - k] & (guess == labels)
            hits[k - 1] += (alive & counted).sum()
            counts[k - 1] += counted.sum()
            ranked[k - 1] += rank_counts(drafter, drafted[counted], labels[counted])
    depth_loss = (loss_sums / weights.clamp_min(1)).tolist()
    shares = ranked / counts.clamp_min(1)[:, None]
    return {
        "loss": sum(depth_loss) / depths,
        "depth_losses": depth_loss,
        "chain": (hits / counts.clamp_min(1)).tolist(),
        "top1": float(hits[0] / counts[0].clamp_min(1)),
        "ranks": shares[0].tolist(),
        "depth_ranks": shares.tolist(),
        "positions": int(counts[0]),
    }


def train_mtp(
    model: Any,
    data: SelfDistillData,
    context: SelfDistillData,
    config: MTPConfig,
    out: Path,
    extra_manifest: dict[str, Any] | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Train MTP modules for the native Llama ``model`` on continuations ``data`` with their
    prompts' pairs ``context`` (``selfdistill.load_or_prefill``), save them (weights +
    manifest) to ``out`` and return the manifest. ``extra_manifest`` adds entries."""
    job = MTPTraining(model, Sequences(data, context, config.max_pairs), config)

    def step() -> float:
        loss = torch.stack(depth_losses(job.drafter, *job.batch())).mean()
        loss.backward()
        return float(loss.detach())

    def held_out(rows: list[int]) -> dict[str, Any]:
        return evaluate(job.drafter, job.sequences, rows)

    return job.fit_and_save(KIND, step, held_out, out, extra_manifest, progress)


def load_mtp(
    folder: Path, model: Any, model_name: str = "smollm2"
) -> tuple[MTPDrafter, dict[str, Any]]:
    """The MTP drafter saved by ``train_mtp`` for ``model``, in the model's dtype, and the
    manifest."""

    def build(vocab_ids: Tensor | None, _: dict, manifest: dict[str, Any]) -> MTPDrafter:
        return MTPDrafter(
            model.config,
            model.tok_embeddings.weight,
            output_weight(model),
            manifest["config"]["depths"],
            vocab_ids,
        )

    return load_feature_drafter(folder, KIND, model, model_name, build)
