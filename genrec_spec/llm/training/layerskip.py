"""Training the exit head of a layer-skip draft on self-distillation data, and loading it back.

The draft is the target's first n layers plus the exit head (``models.llm.exit_head``); only the
head trains. Its inputs: hidden layer n at every continuation position of the data, recomputed
by one truncated forward (``Llama.forward_layers``) over each row's prompt + continuation (the
cache stores the final-normed state only). Its labels: the target's next-token distribution at
the same position, read off the cached final-normed state through the LM head and kept as the
``top_k`` most likely tokens with their probabilities (nearly all of the mass). The
loss is the soft cross-entropy -sum_v p(v) log q(v) over those of the draft vocabulary: KL(p || q)
up to a constant. It pulls the draft's whole distribution q towards p, not just its argmax:
rejection sampling accepts a sampled draft token with probability sum_v min(p, q).

Continuation positions only: the target's greedy text is where drafts are made, and adding the
prompts' positions (human-written text) lowered held-out agreement on SmolLM2.

Held-out rows (whole prompts), on their continuation positions: ``top1``, how often the draft's
most likely token is the target's greedy token (the agreement); ``chain`` per depth k, the
share of positions where the next k tokens all agree (with the real context: exactly how far a
greedy one-path draft gets); ``acceptance``, the mean of sum_v min(p, q) at temperature 1 (one
sampled draft token's acceptance); and the same for plain early exit (the target's final norm
and LM head on layer n: the head before training) under ``early_exit``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm import tqdm

from genrec_spec.llm.training.checkpoint import (
    DrafterError,
    load_drafter,
    output_weight,
    save_drafter,
)
from genrec_spec.llm.training.eagle import draft_vocabulary
from genrec_spec.llm.training.loop import drafter_manifest, fit, held_out_rows
from genrec_spec.llm.training.medusa import split_positions
from genrec_spec.llm.training.selfdistill import SelfDistillData
from genrec_spec.models.llm.exit_head import EarlyExit, ExitHead

KIND = "layerskip"


@dataclass(frozen=True)
class LayerSkipConfig:
    """Defaults of exit-head training."""

    # The draft keeps the target's first n layers (SmolLM2 has 30). Held-out agreement barely
    # grows with more layers while the draft's cost grows with each: at this much data the
    # head, not depth, does the work.
    n_layers: int = 4
    hidden_dim: int = 1536  # the head's feed-forward width (SmolLM2's own)
    steps: int = 800  # optimiser steps
    batch_positions: int = 256  # positions per step
    lr: float = 2e-3  # AdamW peak learning rate
    weight_decay: float = 0.0
    warmup: int = 20  # linear warm-up steps, then cosine decay to 0
    top_k: int = 64  # the target's most likely tokens kept per position as soft labels
    draft_vocab: int = 8192  # tokens the head's LM head keeps (most frequent); 0 = all
    held_out: float = 0.1  # share of rows (prompts) kept out of training for the manifest
    eval_depth: int = 5  # chain agreement reported for depths 1 .. eval_depth
    seed: int = 0  # initialisation, batch draws and held-out rows
    log_every: int = 100  # print the running loss every this many steps


def layer_states(
    model: Any,
    prompts: list[list[int]],
    data: SelfDistillData,
    n_layers: int,
    batch_size: int = 8,
    progress: bool = True,
) -> Tensor:  # [S, D] float32, aligned with data.hidden
    """Hidden layer ``n_layers`` of the native Llama ``model`` at every continuation position of
    ``data`` (the state before tokens[j], as data.hidden[j]), from truncated forwards over each
    row's prompt + continuation, in batches of similar lengths."""
    offsets = data.offsets.tolist()
    sequences = [
        prompts[r] + data.tokens[offsets[r] : offsets[r + 1] - 1].tolist() for r in range(data.rows)
    ]
    states: list[Tensor] = [torch.empty(0)] * data.rows  # per row [G, D]
    order = sorted(range(data.rows), key=lambda r: len(sequences[r]))
    bar = tqdm(total=data.rows, desc=f"layer {n_layers} states", unit="row", disable=not progress)
    for start in range(0, data.rows, batch_size):
        rows = order[start : start + batch_size]
        width = max(len(sequences[r]) for r in rows)
        ids = torch.tensor([sequences[r] + [0] * (width - len(sequences[r])) for r in rows])
        hidden = model.forward_layers(ids, model.new_cache(len(rows), width), n_layers=n_layers)
        for b, r in enumerate(rows):
            first = len(prompts[r]) - 1  # the prompt's last token: the first continuation state
            states[r] = hidden[b, first : first + offsets[r + 1] - offsets[r]].float()
        bar.update(len(rows))
    bar.close()
    return torch.cat(states)


@torch.no_grad()
def soft_labels(
    lm_head: Tensor,  # [V, D] fp32 the target's output projection
    hidden: Tensor,  # [S, D] fp32 the target's final-normed states
    top_k: int,
    chunk: int = 1024,  # positions per [chunk, V] of logits
) -> tuple[Tensor, Tensor]:  # probabilities [S, K] float32, token ids [S, K] int64
    """The target's ``top_k`` most likely next tokens at each position, with their
    probabilities (over the whole vocabulary)."""
    probs, ids = [], []
    for start in range(0, len(hidden), chunk):
        logits = F.linear(hidden[start : start + chunk], lm_head)
        top = logits.log_softmax(-1).topk(top_k, dim=-1)
        probs.append(top.values.exp())
        ids.append(top.indices)
    return torch.cat(probs), torch.cat(ids)


def soft_cross_entropy(
    head: ExitHead,
    states: Tensor,  # [P, D] hidden layer n
    probs: Tensor,  # [P, K] the target's top-k probabilities
    ids: Tensor,  # [P, K] int64 their tokens
    vocab_index: Tensor,  # [V] int64 position in the draft vocabulary, -1 outside
) -> Tensor:  # [] mean over positions of -sum_k p_k log q(ids_k), tokens outside V' skipped
    log_q = head(states).float().log_softmax(-1)  # [P, V']
    column = vocab_index[ids]  # [P, K]
    picked = log_q.gather(1, column.clamp_min(0))
    return -(probs * torch.where(column >= 0, picked, 0.0)).sum(1).mean()


@torch.no_grad()
def evaluate(
    head: ExitHead,
    states: Tensor,  # [S, D] fp32 hidden layer n at every continuation position
    final: Tensor,  # [S, D] fp32 the target's final-normed states there
    tokens: Tensor,  # [S] int64 the target's greedy tokens
    offsets: Tensor,  # [R + 1] int64 row boundaries
    positions: Tensor,  # [P] int64 the positions evaluated (whole rows)
    lm_head: Tensor,  # [V, D] the target's output projection, fp32
    depth: int,
    chunk: int = 256,  # positions per [chunk, V] of probabilities
) -> dict[str, Any]:
    """Agreement, chain agreement per depth 1..``depth`` and sampling acceptance of the draft
    (module docstring) over ``positions``."""
    agree = torch.zeros(len(tokens), dtype=torch.bool)  # [S], False off the positions
    acceptance = 0.0
    for start in range(0, len(positions), chunk):
        index = positions[start : start + chunk]
        q = head.full_logits(states[index]).softmax(-1)  # [C, V]
        p = F.linear(final[index], lm_head).softmax(-1)  # [C, V]
        acceptance += float(torch.minimum(p, q).sum())
        agree[index] = q.argmax(-1) == tokens[index]
    ends = torch.repeat_interleave(offsets[1:], offsets.diff())  # [S] each position's row end
    alive = torch.ones(len(positions), dtype=torch.bool)
    chain = []
    for k in range(depth):
        at = positions + k  # [P] the k-th next token of each start
        has = at < ends[positions]
        alive &= has & agree[at.clamp_max(len(tokens) - 1)]
        chain.append(float(alive.sum() / has.sum().clamp_min(1)))
    return {
        "top1": chain[0],
        "chain": chain,
        "acceptance": acceptance / max(len(positions), 1),
        "positions": len(positions),
    }


def train_layerskip(
    model: Any,
    prompts: list[list[int]],
    data: SelfDistillData,
    config: LayerSkipConfig,
    out: Path,
    extra_manifest: dict[str, Any] | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Train an exit head after layer ``config.n_layers`` of the native Llama ``model`` on the
    continuations ``data`` of ``prompts`` (their token ids, rows in order), save it (weights +
    manifest) to ``out`` and return the manifest. ``extra_manifest`` adds entries."""
    if len(prompts) != data.rows:
        raise DrafterError(
            f"{len(prompts)} prompts for {data.rows} rows of continuations",
            "pass the prompts the self-distillation data was generated from",
        )
    lm_head = output_weight(model).detach().float()  # training runs in fp32
    train, held = split_positions(data.offsets, config.held_out, config.seed)
    if len(train) == 0:
        raise DrafterError(
            "the self-distillation data has no training position",
            "generate more or longer continuations (--n, --max-new-tokens)",
        )
    states = layer_states(model, prompts, data, config.n_layers, progress=progress)  # [S, D]
    probs, ids = soft_labels(lm_head, data.hidden, config.top_k)  # [S, K] each
    held_rows = held_out_rows(data.rows, config.held_out, config.seed).tolist()
    text = torch.cat(
        [data.tokens[train]]
        + [torch.tensor(p) for p, h in zip(prompts, held_rows, strict=True) if not h]
    )  # the training rows' prompts and continuations
    vocab_ids = draft_vocabulary(text, model.config.vocab_size, config.draft_vocab)
    final_norm = model.norm.weight.detach().float()
    with torch.random.fork_rng():
        torch.manual_seed(config.seed)
        head = ExitHead(model.config, final_norm, lm_head, config.hidden_dim, vocab_ids)
    vocab_index = torch.full((model.config.vocab_size,), -1, dtype=torch.long)
    vocab_index[head.vocab_ids] = torch.arange(len(head.vocab_ids))
    generator = torch.Generator().manual_seed(config.seed)

    def step() -> float:
        pick = train[torch.randint(len(train), (config.batch_positions,), generator=generator)]
        loss = soft_cross_entropy(head, states[pick], probs[pick], ids[pick], vocab_index)
        loss.backward()
        return float(loss.detach())

    train_loss = fit(head.parameters(), step, config, desc=KIND, progress=progress)
    held_out = None
    if len(held):
        plain = ExitHead(model.config, final_norm, lm_head, config.hidden_dim)  # untrained
        scored = (states, data.hidden, data.tokens, data.offsets, held, lm_head, config.eval_depth)
        with torch.no_grad():
            loss = soft_cross_entropy(head, states[held], probs[held], ids[held], vocab_index)
        held_out = {
            **evaluate(head.eval(), *scored),
            "loss": float(loss),
            "vocab_coverage": float((vocab_index[data.tokens[held]] >= 0).float().mean()),
            "early_exit": evaluate(plain, *scored),
        }
    extra = {"draft_vocab": len(head.vocab_ids), **(extra_manifest or {})}
    manifest = drafter_manifest(KIND, model, data, config, train_loss, held_out, extra)
    manifest["target"]["hidden_layer"] = config.n_layers  # the head reads layer n
    return save_drafter(out, dict(head.state_dict()), manifest)


def load_layerskip(
    folder: Path, model: Any, model_name: str = "smollm2"
) -> tuple[EarlyExit, dict[str, Any]]:
    """The early-exit draft saved by ``train_layerskip`` for ``model`` (its first n layers and
    the exit head, in the model's dtype) and the manifest."""
    tensors, manifest = load_drafter(folder, KIND, model, model_name)
    lm_head = output_weight(model)
    ids = tensors["vocab_ids"].to(lm_head.device)
    full = len(ids) == model.config.vocab_size
    hidden_dim = tensors["feed_forward.w1.weight"].shape[0]
    with torch.device("meta"):  # parameters come from the checkpoint: no random initialisation
        head = ExitHead(model.config, model.norm.weight, lm_head, hidden_dim, None if full else ids)
    weights = {
        name: t.to(lm_head.device, lm_head.dtype if t.is_floating_point() else t.dtype)
        for name, t in tensors.items()
    }
    head.load_state_dict(weights, assign=True)
    return EarlyExit(model, head.eval(), manifest["config"]["n_layers"]), manifest
