"""Training EAGLE's feature drafter on self-distillation data, and loading it back.

A row's sequence of pairs is its prompt's teacher-forced pairs followed by its continuation's
(``selfdistill``): pair i = (f_i, x_{i+1}), f_i the target's final-normed feature. The drafter
runs over whole sequences at once (a chain with a fresh cache) and learns, at pair i, the next
pair: EAGLE's loss, SmoothL1 between its output and the feature f_{i+1} plus ``ce_weight`` times
the cross-entropy of the LM head (over the draft vocabulary) on its output against x_{i+2}, the
target's greedy token. Uniform noise on the input features (EAGLE's augmentation) accustoms it
to its own imprecise features. Only pairs whose next pair lies in the continuation count: the
prompt is context. AdamW with warm-up and cosine decay (``training.fit``).

Draft vocabulary: the ``draft_vocab`` tokens most frequent in the training rows' text, prompts
and continuations (ties broken by lower id: BPE ids roughly follow frequency). The manifest
says how much of the held-out continuations it covers.

Held-out rows (whole prompts): the loss; the chain acceptance per depth k: from every
continuation position, with the real context, the drafter's top token k steps ahead, each step
fed its own predicted feature and token, all right up to k (how a one-path draft fares under
greedy decoding; depth 1 is the top-1 accuracy); and the rank shares: how often the next token
is the drafter's r-th choice (r < 8), from which EAGLE-1's static tree is shaped
(``tree.likely_choices``).

EAGLE-2 decodes with the same weights (``checkpoint.drafter_kind``): it differs at drafting
only (a dynamic tree).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn import Module
from torch.nn.utils.rnn import pad_sequence

from genrec_spec.llm.training.checkpoint import (
    DrafterError,
    load_drafter,
    output_weight,
    save_drafter,
)
from genrec_spec.llm.training.loop import drafter_manifest, fit, held_out_rows
from genrec_spec.llm.training.selfdistill import SelfDistillData
from genrec_spec.models.llm.eagle_drafter import IGNORE, EagleDrafter, FeatureDrafter

KIND = "eagle"
RANKS = 8  # the held-out rank statistics cover the drafter's first RANKS choices


@dataclass(frozen=True)
class EagleConfig:
    """Defaults of EAGLE drafter training."""

    # Optimiser steps: about 9 passes over train-drafter's default rows at 8 rows a step (more
    # passes over fewer distinct rows draft worse: training.pipeline's EAGLE_PROMPTS)
    steps: int = 800
    batch_rows: int = 8  # sequences (prompt + continuation pairs) per step
    lr: float = 1e-3  # AdamW peak learning rate
    weight_decay: float = 0.0
    warmup: int = 20  # linear warm-up steps, then cosine decay to 0
    ce_weight: float = 0.1  # weight of the token loss next to the feature loss (EAGLE's)
    noise: float = 0.2  # input features get uniform noise in [-noise / 2, noise / 2] (EAGLE's)
    draft_vocab: int = 8192  # tokens the drafter's LM head keeps (most frequent); 0 = all
    held_out: float = 0.1  # share of rows (prompts) kept out of training for the manifest
    eval_depth: int = 5  # chain acceptance reported for depths 1 .. eval_depth
    seed: int = 0  # initialisation, batch draws, noise and held-out rows
    log_every: int = 50  # print the running loss every this many steps


class Sequences:
    """Each row's pairs (prompt then continuation) as one sequence; loss positions. With
    ``max_pairs``, rows keep their last max_pairs pairs (prompt pairs go first), which bounds a
    training step's cost."""

    def __init__(
        self, data: SelfDistillData, context: SelfDistillData, max_pairs: int | None = None
    ) -> None:
        if context.rows != data.rows:
            raise DrafterError(
                f"{context.rows} rows of prompt pairs for {data.rows} rows of continuations",
                "build both from the same prompts (selfdistill.load_or_prefill)",
            )
        self.data, self.context, self.max_pairs = data, context, max_pairs
        self.prompt = context.offsets.tolist()
        self.continuation = data.offsets.tolist()

    def row(self, r: int) -> tuple[Tensor, Tensor, int]:  # [T, D], [T] int64, prompt pairs
        features, tokens, start = self.pairs(r)
        cut = max(len(tokens) - (self.max_pairs or len(tokens)), 0)  # pairs dropped in front
        return features[cut:], tokens[cut:], max(start - cut, 0)

    def pairs(self, r: int) -> tuple[Tensor, Tensor, int]:  # [T, D], [T] int64, prompt pairs
        """Row r's pairs, all of them."""
        prompt = slice(self.prompt[r], self.prompt[r + 1])
        continuation = slice(self.continuation[r], self.continuation[r + 1])
        features = torch.cat([self.context.hidden[prompt], self.data.hidden[continuation]])
        tokens = torch.cat([self.context.tokens[prompt], self.data.tokens[continuation]])
        return features, tokens, prompt.stop - prompt.start

    def learnable(self, r: int) -> bool:
        """Whether row r has a loss position: a pair followed by a continuation pair."""
        pairs = (
            self.prompt[r + 1] - self.prompt[r] + self.continuation[r + 1] - self.continuation[r]
        )
        return pairs >= 2 and self.continuation[r + 1] > self.continuation[r]

    def batch(self, rows: list[int]) -> tuple[Tensor, Tensor, Tensor]:
        """Right-padded features [R, T, D], tokens [R, T] and the loss mask [R, T - 1]: pair i
        learns pair i + 1 when that one is a continuation pair."""
        features, tokens, starts = zip(*(self.row(r) for r in rows), strict=True)
        lengths = torch.tensor([len(t) for t in tokens])  # [R]
        padded = pad_sequence(list(features), batch_first=True)  # [R, T, D]
        nxt = torch.arange(1, padded.shape[1])  # [T - 1] the learnt pair
        mask = (nxt >= torch.tensor(starts)[:, None]) & (nxt < lengths[:, None])
        return padded, pad_sequence(list(tokens), batch_first=True), mask


def draft_vocabulary(tokens: Tensor, vocab_size: int, size: int) -> Tensor | None:  # [V'] int64
    """The ``size`` most frequent of ``tokens`` [S] (ties: lower id first), ascending; None when
    ``size`` is 0 or covers the whole vocabulary."""
    if size <= 0 or size >= vocab_size:
        return None
    counts = torch.bincount(tokens, minlength=vocab_size)
    order = torch.sort(-counts, stable=True).indices  # most frequent first, ties by id
    return order[:size].sort().values


def losses(
    drafter: EagleDrafter,
    out: Tensor,  # [R, T, D] the drafter's outputs over the sequences
    features: Tensor,  # [R, T, D] the pairs' (clean) features
    tokens: Tensor,  # [R, T] int64
    mask: Tensor,  # [R, T - 1] bool: pair i learns pair i + 1
) -> tuple[Tensor, Tensor]:  # feature loss [], token loss [] (means over the learnt pairs)
    predicted = out[:, :-1][mask]  # [P, D]
    feature_loss = F.smooth_l1_loss(predicted, features[:, 1:][mask])
    return feature_loss, token_loss(drafter, predicted, tokens[:, 1:][mask])


def token_loss(
    drafter: FeatureDrafter,
    predicted: Tensor,  # [P, D] predicted features
    targets: Tensor,  # [P] int64 the tokens they should draft
) -> Tensor:  # [] cross-entropy over the draft vocabulary, mean over targets inside it
    labels = drafter.vocab_index[targets]  # [P], IGNORE outside the draft vocabulary
    return F.cross_entropy(
        drafter.logits(predicted), labels, ignore_index=IGNORE, reduction="sum"
    ) / (labels != IGNORE).sum().clamp_min(1)


@torch.no_grad()
def evaluate(
    drafter: EagleDrafter,
    sequences: Sequences,
    rows: list[int],
    depth: int,
    ce_weight: float,
    chunk: int = 32,  # start positions rolled out at a time
) -> dict[str, Any]:
    """Held-out loss (feature, token, total), chain acceptance per depth 1..``depth``, rank
    shares and the share of continuation tokens inside the draft vocabulary (module
    docstring)."""
    hits, counts, ranked = torch.zeros(depth), torch.zeros(depth), torch.zeros(RANKS)
    feature_sum = token_sum = weight = covered = total = 0.0
    for r in rows:
        features, tokens, start = sequences.row(r)
        length = len(tokens)
        cache = drafter.new_cache(1, length + depth)
        out = drafter(features[None], tokens[None], cache)  # [1, T, D]
        cache.commit(torch.arange(length)[None], torch.tensor([length]))
        mask = sequences.batch([r])[2]
        feature_loss, token_loss = losses(drafter, out, features[None], tokens[None], mask)
        learnt = int(mask.sum())
        feature_sum += float(feature_loss) * learnt
        token_sum += float(token_loss) * learnt
        weight += learnt
        covered += int((drafter.vocab_index[tokens[start:]] != IGNORE).sum())
        total += length - start
        right, count, rank = acceptance_counts(drafter, cache, out[0], tokens, start, depth, chunk)
        hits, counts, ranked = hits + right, counts + count, ranked + rank
    return {
        "loss": (feature_sum + ce_weight * token_sum) / max(weight, 1),
        "feature_loss": feature_sum / max(weight, 1),
        "token_loss": token_sum / max(weight, 1),
        "chain": (hits / counts.clamp_min(1)).tolist(),
        "top1": float(hits[0] / counts[0].clamp_min(1)),
        "ranks": (ranked / counts[0].clamp_min(1)).tolist(),
        "vocab_coverage": covered / max(total, 1),
        "positions": int(counts[0]),
    }


def acceptance_counts(
    drafter: EagleDrafter,
    cache: Any,  # one row's cache holding all its T real pairs
    out: Tensor,  # [T, D] the drafter's outputs over them
    tokens: Tensor,  # [T] int64 the row's tokens
    start: int,  # the row's first continuation pair
    depth: int,
    chunk: int,
) -> tuple[Tensor, Tensor, Tensor]:  # chains right [depth], counted [depth], ranks [RANKS]
    """One row's chain acceptance and rank counts from every continuation position."""
    hits, counts, ranked = torch.zeros(depth), torch.zeros(depth), torch.zeros(RANKS)
    length = len(tokens)
    for first in range(max(start - 1, 0), length - 1, chunk):
        index = torch.arange(first, min(first + chunk, length - 1))  # [S] pair i predicts i + 1
        ranked += rank_counts(drafter, out[index], tokens[index + 1])
        right, count = _rollout(drafter, cache, out[index], tokens, index, depth)
        hits += right
        counts += count
    return hits, counts, ranked


def rank_counts(
    drafter: FeatureDrafter,
    features: Tensor,  # [S, D] predicted features
    labels: Tensor,  # [S] int64 the true next tokens
) -> Tensor:  # [RANKS] how often the label is the drafter's r-th choice
    logits = drafter.logits(features)  # [S, V']
    column = drafter.vocab_index[labels]  # [S], IGNORE outside the draft vocabulary
    rank = (logits > logits.gather(1, column.clamp_min(0)[:, None])).sum(1)  # [S]
    return torch.bincount(rank[(column != IGNORE) & (rank < RANKS)], minlength=RANKS)


def _rollout(
    drafter: EagleDrafter,
    cache: Any,  # one row's cache holding all its T real pairs
    feature: Tensor,  # [S, D] predicted features of pairs index + 1
    tokens: Tensor,  # [T] int64 the row's tokens
    index: Tensor,  # [S] int64 start pairs
    depth: int,
) -> tuple[Tensor, Tensor]:  # right [depth], counted [depth]: chains all right to depth k
    """From each start, draft ``depth`` tokens on the drafter's own features (each start a row
    of a copy of the cache cut back to its real pairs 0 .. i)."""
    starts = len(index)
    rollout = drafter.new_cache(starts, cache.max_len)
    rollout.k[:], rollout.v[:] = cache.k, cache.v  # [1, 1, H, T, D] broadcast to the starts
    rollout.lengths = index + 1
    alive = torch.ones(starts, dtype=torch.bool)
    right, counted = torch.zeros(depth), torch.zeros(depth)
    for k in range(depth):
        label = index + 1 + k  # [S] the pair whose token this step drafts
        has = label < len(tokens)
        guess = drafter.vocab_ids[drafter.logits(feature).argmax(-1)]  # [S]
        alive &= has & (guess == tokens[label.clamp_max(len(tokens) - 1)])
        right[k], counted[k] = alive.sum(), has.sum()
        if k + 1 < depth:
            feature = drafter(feature[:, None], guess[:, None], rollout)[:, 0]
            rollout.commit(torch.zeros(starts, 1, dtype=torch.long), torch.ones_like(index))
    return right, counted


def train_eagle(
    model: Any,
    data: SelfDistillData,
    context: SelfDistillData,
    config: EagleConfig,
    out: Path,
    extra_manifest: dict[str, Any] | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Train a feature drafter for the native Llama ``model`` on continuations ``data`` with
    their prompts' pairs ``context`` (``selfdistill.load_or_prefill``), save it (weights +
    manifest) to ``out`` and return the manifest. ``extra_manifest`` adds entries."""
    job = FeatureTraining(model, Sequences(data, context), config)
    drafter, generator = job.drafter, job.generator

    def step() -> float:
        features, tokens, mask = job.batch()
        noise = (torch.rand(features.shape, generator=generator) - 0.5) * config.noise
        out = drafter(features + noise, tokens, drafter.new_cache(*tokens.shape))  # [R, T, D]
        feature_loss, next_token_loss = losses(drafter, out, features, tokens, mask)
        loss = feature_loss + config.ce_weight * next_token_loss
        loss.backward()
        return float(loss.detach())

    def held_out(rows: list[int]) -> dict[str, Any]:
        return evaluate(drafter, job.sequences, rows, config.eval_depth, config.ce_weight)

    return job.fit_and_save(KIND, step, held_out, out, extra_manifest, progress)


class FeatureTraining:
    """A feature drafter (EAGLE, EAGLE-3) in training for the native Llama ``model`` on
    ``sequences``: the rows with a pair to learn, split by ``config.held_out``, and a fresh
    drafter whose draft vocabulary is the training rows' most frequent tokens
    (``config.draft_vocab``; ``new_drafter`` builds it)."""

    def __init__(self, model: Any, sequences: Sequences, config: Any, fused: int = 1) -> None:
        self.model, self.sequences, self.config, self.fused = model, sequences, config, fused
        rows = sequences.data.rows
        held = held_out_rows(rows, config.held_out, config.seed).tolist()
        self.train = [r for r in range(rows) if not held[r] and sequences.learnable(r)]
        self.held = [r for r in range(rows) if held[r] and sequences.learnable(r)]
        if not self.train:
            raise DrafterError(
                "the self-distillation data has no training row with a pair to learn",
                "generate more or longer continuations (--n, --max-new-tokens >= 2)",
            )
        text = torch.cat([sequences.row(r)[1] for r in self.train])  # the training rows' tokens
        vocab_ids = draft_vocabulary(text, model.config.vocab_size, config.draft_vocab)
        with torch.random.fork_rng():
            torch.manual_seed(config.seed)
            self.drafter = self.new_drafter(vocab_ids)
        self.generator = torch.Generator().manual_seed(config.seed)  # batch draws (and noise)

    def new_drafter(self, vocab_ids: Tensor | None) -> FeatureDrafter:  # vocab_ids [V'] or None
        """A freshly initialised drafter in fp32 with the draft vocabulary ``vocab_ids``."""
        model = self.model
        return EagleDrafter(
            model.config,
            model.tok_embeddings.weight.float(),
            output_weight(model).float(),
            vocab_ids,
            self.fused,
        )

    def batch(self) -> tuple[Tensor, Tensor, Tensor]:  # features, tokens, mask (Sequences.batch)
        """``config.batch_rows`` training rows drawn at random."""
        draw = torch.randint(len(self.train), (self.config.batch_rows,), generator=self.generator)
        return self.sequences.batch([self.train[i] for i in draw.tolist()])

    def fit_and_save(
        self,
        kind: str,
        step: Callable[[], float],  # one batch's loss, backpropagated (``training.fit``)
        held_out: Callable[[list[int]], dict[str, Any]],  # held-out metrics of rows
        out: Path,
        extra_manifest: dict[str, Any] | None,
        progress: bool,
        hidden_layer: list[int] | None = None,  # EAGLE-3: the fused layers
    ) -> dict[str, Any]:
        """Train the drafter with ``step``, measure it on the held-out rows, save it (weights +
        manifest) to ``out`` and return the manifest."""
        drafter, config, sequences = self.drafter, self.config, self.sequences
        train_loss = fit(drafter.parameters(), step, config, desc=kind, progress=progress)
        drafter.eval()
        measured = held_out(self.held) if self.held else None
        extra = extras(drafter, sequences.context, extra_manifest)
        manifest = drafter_manifest(
            kind, self.model, sequences.data, config, train_loss, measured, extra, hidden_layer
        )
        return save_drafter(out, dict(drafter.state_dict()), manifest)


def extras(
    drafter: EagleDrafter, context: SelfDistillData, extra_manifest: dict[str, Any] | None
) -> dict[str, Any]:
    """A feature drafter's manifest entries beyond ``drafter_manifest``'s."""
    return {
        "context": {"key": context.key, "positions": len(context.tokens)},
        "draft_vocab": len(drafter.vocab_ids),
        **(extra_manifest or {}),
    }


def load_eagle(
    folder: Path, model: Any, model_name: str = "smollm2", kind: str = KIND
) -> tuple[EagleDrafter, dict[str, Any]]:
    """The drafter saved by ``train_eagle`` (or, kind "eagle3", ``eagle3.train_eagle3``) for
    ``model``, in the model's dtype, and the manifest."""

    def build(vocab_ids: Tensor | None, tensors: dict[str, Tensor], _: dict) -> EagleDrafter:
        fuse = tensors.get("fuse.0.weight")  # [D, k D], EAGLE-3's only
        fused = 1 if fuse is None else fuse.shape[1] // model.config.dim
        return EagleDrafter(
            model.config, model.tok_embeddings.weight, output_weight(model), vocab_ids, fused
        )

    return load_feature_drafter(folder, kind, model, model_name, build)


def load_feature_drafter(
    folder: Path,
    kind: str,
    model: Any,
    model_name: str,
    build: Callable[[Tensor | None, dict[str, Tensor], dict[str, Any]], Module],
) -> tuple[Any, dict[str, Any]]:
    """A feature drafter saved for ``model`` (``checkpoint.load_drafter``), in the model's dtype
    and eval mode, and its manifest. ``build(vocab_ids, tensors, manifest)`` makes the drafter
    (on the meta device: its parameters come from the checkpoint) with the saved draft
    vocabulary [V'] (None when it is the whole vocabulary)."""
    tensors, manifest = load_drafter(folder, kind, model, model_name)
    lm_head = output_weight(model)
    ids = tensors["vocab_ids"].to(lm_head.device)
    full = len(ids) == model.config.vocab_size
    with torch.device("meta"):
        drafter = build(None if full else ids, tensors, manifest)
    weights = {
        name: t.to(lm_head.device, lm_head.dtype if t.is_floating_point() else t.dtype)
        for name, t in tensors.items()
    }
    drafter.load_state_dict(weights, assign=True)
    return drafter.eval(), manifest
