"""A distilled draft model: training it on self-distillation data, and loading it back.

The draft is a small Llama at the target's widths: a few decoder layers, started as copies of
chosen target layers (``layers``) and trained, between the target's token embeddings and LM head,
which it shares by reference and never trains (the draft speaks the target's tokenizer; its
checkpoint holds only its layers and final norm). It drafts like any target-like draft
(``DraftModelProposer``), and ``models.llm.llama_loading.to_hf`` turns it into a transformers model
for Hugging Face's own assisted generation (``generate(assistant_model=...)``).

Data: each row's whole text, prompt then continuation (``selfdistill``: the prompts'
teacher-forced pairs followed by the target's greedy continuation, as in EAGLE's ``Sequences``).
At every position but the last the cache holds the target's final-normed hidden state, so the
target's next-token distribution p is its LM head's softmax there, recomputed per batch.

Loss: KL(p || q) at every position of the text, q the draft's distribution (teacher-forced), so
the draft learns the whole distribution: greedy acceptance needs its argmax, rejection sampling's
acceptance is sum min(p, q). Batches are rows of similar lengths (little padding); AdamW with
warm-up and cosine decay (``training.fit``). The LM head's [P, V] logits are computed a chunk of
positions at a time.

Held-out rows (whole prompts), over continuation positions (where decoding drafts): the KL, the
top-1 agreement with the target, the sampling acceptance sum min(p, q) at temperature 1, and
the greedy chain acceptance per depth k (the draft's top token right at k positions in a row;
teacher forcing on the target's greedy text is exactly what a draft sees along an accepted
chain).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from genrec_spec.llm.training.checkpoint import (
    DrafterError,
    load_drafter,
    output_weight,
    save_drafter,
)
from genrec_spec.llm.training.eagle import Sequences
from genrec_spec.llm.training.loop import drafter_manifest, fit, held_out_rows
from genrec_spec.llm.training.selfdistill import SelfDistillData
from genrec_spec.models.llm.llama import Llama, begin_tree_pass, rope_tables

KIND = "draft"  # its folder and manifest kind; it decodes as the method "distilled"
CHUNK = 512  # positions whose [CHUNK, V] logits are live at a time


@dataclass(frozen=True)
class DistillConfig:
    """Defaults of distilled draft training."""

    # Target layers the draft's layers start from: the first ones agree with the target more
    # after training than layers spread over its depth.
    layers: tuple[int, ...] = (0, 1, 2, 3)
    steps: int = 240  # optimiser steps
    batch_rows: int = 4  # rows (prompt + continuation) per step
    lr: float = 3e-3  # AdamW peak learning rate
    weight_decay: float = 0.0
    warmup: int = 10  # linear warm-up steps, then cosine decay to 0
    held_out: float = 0.1  # share of rows (prompts) kept out of training for the manifest
    eval_depth: int = 5  # chain acceptance reported for depths 1 .. eval_depth
    seed: int = 0  # batch draws and held-out rows
    log_every: int = 20  # print the running loss every this many steps


def draft_from(model: Llama, layers: dict[str, Tensor], n_layers: int) -> Llama:
    """A Llama of ``n_layers`` with the given layer and final-norm weights (``layers.*``,
    ``norm.weight``) around ``model``'s token embeddings and LM head (shared, not copied)."""
    shared = {
        name: weight
        for name, weight in model.state_dict().items()
        if name in ("tok_embeddings.weight", "output.weight")
    }
    config = replace(model.config, n_layers=n_layers)
    return Llama.from_state_dict(config, {**shared, **layers}, dtype=output_weight(model).dtype)


def initial_draft(model: Llama, layers: tuple[int, ...]) -> Llama:
    """The draft before training: copies of the target layers ``layers`` and its final norm."""
    bad = [i for i in layers if not 0 <= i < model.config.n_layers]
    if not layers or bad:
        raise DrafterError(
            f"draft layers {list(layers)} must be a non-empty list of target layers",
            f"pick layers from 0 .. {model.config.n_layers - 1}",
        )
    state = model.state_dict()
    copies = {"norm.weight": state["norm.weight"].clone()}
    for new, old in enumerate(layers):
        prefix = f"layers.{old}."
        for name, weight in state.items():
            if name.startswith(prefix):
                copies[f"layers.{new}.{name[len(prefix) :]}"] = weight.clone()
    return draft_from(model, copies, len(layers))


def trained_weights(draft: Llama) -> dict[str, Tensor]:
    """What the checkpoint holds: the draft's layers and final norm (not the shared tensors)."""
    return {
        name: weight
        for name, weight in draft.state_dict().items()
        if name.startswith("layers.") or name == "norm.weight"
    }


def hidden_states(draft: Llama, ids: Tensor) -> Tensor:  # [R, T] -> [R, T, D]
    """The draft's final-normed hidden states over whole sequences, with autograd (``Llama``'s
    forward is inference-only): one chain pass, padding after the text. Each layer writes its K/V
    to a fresh cache of its own: in one shared buffer, a later layer's write would modify what an
    earlier layer's attention saved for the backward pass."""
    caches = [draft.new_cache(*ids.shape) for _ in draft.layers]
    rope = rope_tables(draft.config, ids.device)
    plan, cos, sin = begin_tree_pass(caches[0], ids.shape[1], None, rope)  # shared by all
    x = draft.tok_embeddings(ids)
    for layer, cache in zip(draft.layers, caches, strict=True):
        cache.begin_pass(ids.shape[1])
        x = layer(x, cos, sin, cache, plan)
    return draft.norm(x)


def relative_cost(draft: Llama, model: Llama) -> float:
    """A draft forward's cost relative to the target's, in multiply-adds per token (layers and
    LM head; the embedding lookup is free). The LM head runs in both, so a draft of a few
    layers still costs a sizeable share of the target."""

    def cost(llama: Llama) -> int:
        return sum(p.numel() for p in llama.layers.parameters()) + output_weight(llama).numel()

    return cost(draft) / cost(model)


class Texts:
    """Each row's text with the target's state at its positions (module docstring)."""

    def __init__(
        self, data: SelfDistillData, context: SelfDistillData, prompts: list[list[int]]
    ) -> None:
        self.sequences = Sequences(data, context)
        # [R] each prompt's first token: the pairs hold the tokens after it
        self.first = torch.tensor([prompt[0] for prompt in prompts])

    def row(self, r: int) -> tuple[Tensor, Tensor, int]:  # ids [T], features [T, D], prompt pairs
        """Token i of ``ids`` is followed by the target's distribution at ``features[i]``; the
        continuation's positions start at the returned prompt pair count."""
        features, tokens, start = self.sequences.row(r)  # pair i = (f_i, x_{i+1})
        return torch.cat([self.first[r : r + 1], tokens[:-1]]), features, start

    def length(self, r: int) -> int:
        return len(self.sequences.row(r)[1])

    def batch(self, rows: list[int]) -> tuple[Tensor, Tensor, Tensor]:
        """Right-padded ids [R, T], features [R, T, D] and the real positions [R, T] bool."""
        ids, features, _ = zip(*(self.row(r) for r in rows), strict=True)
        lengths = torch.tensor([len(i) for i in ids])  # [R]
        mask = torch.arange(int(lengths.max())) < lengths[:, None]
        return pad_sequence(list(ids), batch_first=True), pad_sequence(list(features), True), mask


def kl_backward(
    student: Tensor,  # [P, D] the draft's final-normed states (a leaf: gradients land in .grad)
    teacher: Tensor,  # [P, D] the target's
    lm_head: Tensor,  # [V, D]
    denominator: int,  # positions the loss is averaged over
) -> float:  # the summed KL of these positions / denominator
    """KL(p_target || q_draft) through the shared LM head, one CHUNK of positions at a time, its
    gradient accumulated into ``student.grad``."""
    total = 0.0
    for start in range(0, len(student), CHUNK):
        chunk = slice(start, start + CHUNK)
        log_q = F.linear(student[chunk], lm_head).log_softmax(-1)  # [C, V]
        log_p = F.linear(teacher[chunk], lm_head).log_softmax(-1)  # [C, V]
        loss = F.kl_div(log_q, log_p, reduction="sum", log_target=True) / denominator
        loss.backward()
        total += float(loss.detach())
    return total


@torch.no_grad()
def evaluate(draft: Llama, texts: Texts, rows: list[int], depth: int) -> dict[str, Any]:
    """Held-out statistics over the rows' continuation positions (module docstring)."""
    lm_head = output_weight(draft).float()
    kl = accept = 0.0
    hits, counts = torch.zeros(depth), torch.zeros(depth)
    for r in rows:
        ids, features, start = texts.row(r)
        student = hidden_states(draft, ids[None])[0, start:].float()  # [G, D]
        log_q = F.linear(student, lm_head).log_softmax(-1)  # [G, V]
        log_p = F.linear(features[start:], lm_head).log_softmax(-1)
        kl += float(F.kl_div(log_q, log_p, reduction="sum", log_target=True))
        accept += float(torch.minimum(log_p, log_q).exp().sum())
        right = (log_q.argmax(-1) == log_p.argmax(-1)).float()  # [G]
        chain = right
        for k in range(min(depth, len(right))):  # chain[j]: right at j .. j + k
            hits[k] += chain.sum()
            counts[k] += len(chain)
            chain = chain[:-1] * right[k + 1 :]
    positions = max(int(counts[0]), 1)
    return {
        "kl": kl / positions,
        "top1": float(hits[0] / positions),
        "sampling_acceptance": accept / positions,
        "chain": (hits / counts.clamp_min(1)).tolist(),
        "positions": int(counts[0]),
    }


def train_distilled(
    model: Llama,
    data: SelfDistillData,
    context: SelfDistillData,
    prompts: list[list[int]],  # the token ids the data was made from
    config: DistillConfig,
    out: Path,
    extra_manifest: dict[str, Any] | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Train a draft for the native Llama ``model`` on continuations ``data`` of ``prompts`` with
    the prompts' pairs ``context`` (``selfdistill.load_or_prefill``), save it (weights +
    manifest) to ``out`` and return the manifest. ``extra_manifest`` adds entries (the CLI's
    command)."""
    texts = Texts(data, context, prompts)
    held = held_out_rows(data.rows, config.held_out, config.seed).tolist()
    train = sorted((r for r in range(data.rows) if not held[r]), key=texts.length)
    if not any(texts.length(r) for r in train):
        raise DrafterError(
            "the self-distillation data has no training row with a position to learn",
            "generate more or longer continuations (--n, --max-new-tokens)",
        )
    draft = initial_draft(model, config.layers)
    for shared in (draft.tok_embeddings, draft.output):  # the target's: frozen
        if shared is not None:
            shared.requires_grad_(False)
    lm_head = output_weight(draft)
    # Rows of similar lengths batch together: padding costs as much as text.
    batches = [train[i : i + config.batch_rows] for i in range(0, len(train), config.batch_rows)]
    generator = torch.Generator().manual_seed(config.seed)

    def step() -> float:
        rows = batches[int(torch.randint(len(batches), (), generator=generator))]
        ids, features, mask = texts.batch(rows)
        student = hidden_states(draft, ids)[mask]  # [P, D]
        leaf = student.detach().requires_grad_()
        loss = kl_backward(leaf, features[mask], lm_head, len(leaf))
        student.backward(leaf.grad)
        return loss

    train_loss = fit(
        [p for p in draft.parameters() if p.requires_grad],
        step,
        config,
        desc=KIND,
        progress=progress,
    )
    held_rows = [r for r in range(data.rows) if held[r]]
    held_out = evaluate(draft, texts, held_rows, config.eval_depth) if held_rows else None
    extra = {
        "context": {"key": context.key, "positions": len(context.tokens)},
        "relative_cost": relative_cost(draft, model),
        **(extra_manifest or {}),
    }
    manifest = drafter_manifest(KIND, model, data, config, train_loss, held_out, extra)
    return save_drafter(out, trained_weights(draft), manifest)


def load_distilled(
    folder: Path, model: Llama, model_name: str = "smollm2"
) -> tuple[Llama, dict[str, Any]]:
    """The draft saved by ``train_distilled`` for ``model`` (a native Llama in the model's dtype,
    sharing its embeddings and LM head) and the manifest."""
    tensors, manifest = load_drafter(folder, KIND, model, model_name)
    n_layers = len(manifest["config"]["layers"])
    return draft_from(model, tensors, n_layers), manifest
