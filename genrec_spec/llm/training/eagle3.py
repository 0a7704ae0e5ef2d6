"""Training EAGLE-3's drafter (Li et al., 2025): EAGLE's one-layer feature drafter reading a
fusion of the target's low, mid and high layers, trained with training-time test.

Features: EAGLE's sequences (``eagle.Sequences``: a row's prompt pairs, then its continuation
pairs) with each pair's feature the concatenation of the target's hidden layers ``layers`` at
that position [T, k D]. The self-distillation cache holds the final layer only, so one
teacher-forced target forward per row (its prompt then its continuation, the target's own
greedy text) recomputes them when training starts: the cached files stay as they are.

Training-time test. At step 0 the drafter runs over the real pairs (a chain): its output at
pair i is its feature of position i + 1 and drafts token x_{i+2}. At step j > 0 it runs, from
every start i, on its own step j - 1 output at that start paired with the true next token, as
when drafting: node (j, i) feeds (its predicted feature of position i + j, x_{i+j+1}), attends
to the real pairs 0 .. i and its own earlier steps from i (a tree hung under node (0, i): that
branch is what a draft chain sees), and drafts x_{i+j+2}. The loss is the mean over the
``unroll`` steps of the cross-entropy on the target's tokens at the continuation positions;
there is no feature regression (EAGLE-3 drops it) and no input noise (the drafter meets its
own imprecise features instead). Each step is one pass over its own nodes, the earlier steps'
keys and values kept, and steps j > 0 start only where a draft is learnt (``unrolled_losses``).

Held-out rows: the per-step losses and EAGLE's chain acceptance and rank shares
(``eagle.acceptance_counts``). Decoding uses EAGLE-2's dynamic tree with the fused features
(``Eagle2Proposer`` given the layers; ``generate --method eagle3``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from genrec_spec.llm.training.checkpoint import DrafterError
from genrec_spec.llm.training.eagle import (
    RANKS,
    FeatureTraining,
    Sequences,
    acceptance_counts,
    token_loss,
)
from genrec_spec.llm.training.selfdistill import SelfDistillData
from genrec_spec.models.llm.eagle_drafter import EagleDrafter

KIND = "eagle3"


@dataclass(frozen=True)
class Eagle3Config:
    """Defaults of EAGLE-3 drafter training."""

    steps: int = 800  # optimiser steps: about 10 passes over train-drafter's default rows
    batch_rows: int = 8  # sequences (prompt + continuation pairs) per step
    lr: float = 1e-3  # AdamW peak learning rate
    weight_decay: float = 0.0
    warmup: int = 20  # linear warm-up steps, then cosine decay to 0
    unroll: int = 3  # training-time test: drafter steps from every position
    # Rows keep their last max_pairs pairs (the continuation and the prompt's end): a step's
    # pass scores up to unroll x pairs nodes per row, and the CPU attention is differentiable on
    # its dense path only (batch_rows x nodes^2 <= 2^24 mask elements, kernels.tree_plan).
    max_pairs: int = 384
    draft_vocab: int = 8192  # tokens the drafter's LM head keeps (most frequent); 0 = all
    held_out: float = 0.1  # share of rows (prompts) kept out of training for the manifest
    eval_depth: int = 5  # chain acceptance reported for depths 1 .. eval_depth
    seed: int = 0  # initialisation, batch draws and held-out rows
    log_every: int = 50  # print the running loss every this many steps


def fused_layers(n_layers: int) -> tuple[int, ...]:
    """Low, mid and high hidden layers: 2, 15 and 28 of SmolLM2's 30 (0 = the embeddings,
    ``n_layers`` the final-normed state)."""
    return tuple(round(share * n_layers) for share in (1 / 15, 1 / 2, 14 / 15))


class LayerSequences(Sequences):
    """``Sequences`` whose features are the target's ``layers`` concatenated (module
    docstring)."""

    def __init__(
        self,
        model: Any,
        data: SelfDistillData,
        context: SelfDistillData,
        prompts: list[list[int]],
        layers: tuple[int, ...],
        max_pairs: int,  # rows keep their last max_pairs pairs (Eagle3Config)
        batch_size: int = 8,  # rows per target pass
    ) -> None:
        super().__init__(data, context, max_pairs)
        if [len(p) - 1 for p in prompts] != context.offsets.diff().tolist():
            raise DrafterError(
                "the prompts do not match the prompt pairs",
                "pass the prompts the pairs were built from (selfdistill.load_or_prefill)",
            )
        self.layers: list[Tensor] = []  # per row [T, k D]
        for first in range(0, data.rows, batch_size):
            rows = range(first, min(first + batch_size, data.rows))
            # Pair t's feature is the state at position t, whose next token is the pair's.
            texts = [
                torch.cat([torch.tensor(prompts[r][:1]), Sequences.pairs(self, r)[1][:-1]])
                for r in rows
            ]  # [T] each
            ids = pad_sequence(texts, batch_first=True)  # [B, T]
            hidden = model.hidden_states(ids, model.new_cache(*ids.shape), layers)
            fused = torch.cat([hidden[i] for i in layers], dim=-1).float()  # [B, T, k D]
            self.layers += [fused[b, : len(text)] for b, text in enumerate(texts)]

    def pairs(self, r: int) -> tuple[Tensor, Tensor, int]:  # [T, k D], [T] int64, prompt pairs
        _, tokens, start = super().pairs(r)
        return self.layers[r], tokens, start


def unrolled_losses(
    drafter: EagleDrafter,
    features: Tensor,  # [R, T, k D] the target's layers at each pair
    tokens: Tensor,  # [R, T] int64
    mask: Tensor,  # [R, T - 1] bool: pair i learns pair i + 1
    unroll: int,
) -> list[Tensor]:  # token loss [] per training-time-test step
    """The training-time test of the module docstring, in one pass per step over that step's
    nodes only (``EagleDrafter.forward_with``): step 0 is a causal chain over the real pairs
    whose keys and values are kept; node (j, i) of step j > 0 attends to the real pairs 0 .. i
    and to its own branch's nodes (1, i) .. (j, i), nothing else, so each branch's keys enter
    as one score per node (EAGLE-3's own implementation does the same). Steps j > 0 run only
    from the starts whose drafts some step learns (row r's, from its first learnt pair less
    unroll - 1 to its last): a start in the prompt or the padding feeds no loss. Both leave the
    losses those of the drafter run on each branch as a chain (test_eagle3) at a lower cost
    than rerunning all earlier nodes through the cache's tree attention from every start."""
    rows, length = tokens.shape
    steps = min(unroll, length - 1)
    real_k, real_v = [], []  # step 0's keys and values [R, T, Hkv, Dh]

    def causal(q: Tensor, k: Tensor, v: Tensor) -> Tensor:  # q [R, T, Hq, Dh] -> the same
        real_k.append(k)
        real_v.append(v)
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(
            1, 2
        )

    positions = torch.arange(length).expand(rows, -1)  # [R, T]
    out = drafter.forward_with(drafter.fuse(features), tokens, positions, causal)  # [R, T, D]
    losses = [token_loss(drafter, out[:, :-1][mask], tokens[:, 1:][mask])]
    # Row r's starts i = first[r] + k, k < width, up to its last learnt pair (clamped past
    # it: those nodes learn nothing). Node (j, i) is fed (its step j - 1 output, x_{i+j+1}) and
    # drafts x_{i+j+2}; it is learnt where pair i + j learns pair i + j + 1.
    index = torch.arange(length - 1)
    last = torch.where(mask, index, -1).amax(dim=1)  # [R] last learnt pair, -1 = none
    first = torch.where(mask, index, length).amin(dim=1).clamp_max(last)  # [R]
    first = (first - (steps - 1)).clamp_min(0)
    width = max(int((last - first).max()), 1)
    starts = torch.minimum(first[:, None] + torch.arange(width), last.clamp_min(0)[:, None])
    sees = torch.arange(length) <= starts[..., None]  # [R, W, T] start i sees pairs 0 .. i
    branch_k, branch_v = [], []  # steps 1 .. j's keys and values [R, W, Hkv, Dh]

    def branched(q: Tensor, k: Tensor, v: Tensor) -> Tensor:  # q [R, W, Hq, Dh] -> the same
        branch_k.append(k)
        branch_v.append(v)
        return _branch_attention(q, real_k[0], real_v[0], sees, branch_k, branch_v)

    previous = out.gather(1, starts[..., None].expand(-1, -1, out.shape[-1]))  # [R, W, D]
    for j in range(1, steps):
        ahead = (starts + j).clamp_max(length - 1)  # [R, W] index of x_{i+j+1}
        previous = drafter.forward_with(previous, tokens.gather(1, ahead), starts + j, branched)
        learnt = mask.gather(1, ahead.clamp_max(length - 2)) & (starts + j < length - 1)
        learnt &= torch.arange(width) < (last - first)[:, None]  # [R, W] not a clamped copy
        targets = tokens.gather(1, (ahead + 1).clamp_max(length - 1))  # [R, W] x_{i+j+2}
        losses.append(token_loss(drafter, previous[learnt], targets[learnt]))
    return losses


def _branch_attention(
    q: Tensor,  # [R, W, Hq, Dh] step j's nodes, one per start
    real_k: Tensor,  # [R, T, Hkv, Dh] the real pairs'
    real_v: Tensor,  # [R, T, Hkv, Dh]
    sees: Tensor,  # [R, W, T] bool: which real pairs each start sees
    branch_k: list[Tensor],  # j x [R, W, Hkv, Dh] steps 1 .. j at the same starts
    branch_v: list[Tensor],
) -> Tensor:  # [R, W, Hq, Dh]
    """Softmax attention of each node over its visible real pairs and its own branch. Query
    heads are grouped over their key/value head (G = Hq / Hkv), so no key is copied per head."""
    length = real_k.shape[1]  # T
    q = (q * q.shape[-1] ** -0.5).unflatten(2, (real_k.shape[2], -1))  # [R, W, Hkv, G, Dh]
    real = torch.einsum("rwhgd,rthd->rwhgt", q, real_k)
    real = real.masked_fill(~sees[:, :, None, None], float("-inf"))  # [R, W, Hkv, G, T]
    own = torch.einsum("rwhgd,rwhjd->rwhgj", q, torch.stack(branch_k, dim=3))  # [.., G, j]
    weights = torch.cat([real, own], dim=-1).softmax(dim=-1)
    out = torch.einsum("rwhgt,rthd->rwhgd", weights[..., :length], real_v)
    out = out + torch.einsum("rwhgj,rwhjd->rwhgd", weights[..., length:], torch.stack(branch_v, 3))
    return out.flatten(2, 3)


@torch.no_grad()
def evaluate(
    drafter: EagleDrafter,
    sequences: LayerSequences,
    rows: list[int],
    depth: int,
    unroll: int,
    chunk: int = 32,  # start positions rolled out at a time
) -> dict[str, Any]:
    """Held-out loss per training-time-test step, chain acceptance per depth 1..``depth`` and
    rank shares (as ``eagle.evaluate``)."""
    hits, counts, ranked = torch.zeros(depth), torch.zeros(depth), torch.zeros(RANKS)
    step_sums, weight = torch.zeros(unroll), 0
    for r in rows:
        features, tokens, start = sequences.row(r)
        batch = sequences.batch([r])
        learnt = int(batch[2].sum())
        step_losses = torch.stack(unrolled_losses(drafter, *batch, unroll))
        step_sums[: len(step_losses)] += step_losses * learnt
        weight += learnt
        length = len(tokens)
        cache = drafter.new_cache(1, length + depth)
        out = drafter(drafter.fuse(features[None]), tokens[None], cache)  # [1, T, D]
        cache.commit(torch.arange(length)[None], torch.tensor([length]))
        right, count, rank = acceptance_counts(drafter, cache, out[0], tokens, start, depth, chunk)
        hits, counts, ranked = hits + right, counts + count, ranked + rank
    step_losses = (step_sums / max(weight, 1)).tolist()
    return {
        "loss": sum(step_losses) / unroll,
        "step_losses": step_losses,
        "chain": (hits / counts.clamp_min(1)).tolist(),
        "top1": float(hits[0] / counts[0].clamp_min(1)),
        "ranks": (ranked / counts[0].clamp_min(1)).tolist(),
        "positions": int(counts[0]),
    }


def train_eagle3(
    model: Any,
    data: SelfDistillData,
    context: SelfDistillData,
    prompts: list[list[int]],
    config: Eagle3Config,
    out: Path,
    extra_manifest: dict[str, Any] | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Train an EAGLE-3 drafter for the native Llama ``model`` on continuations ``data`` with
    their prompts' pairs ``context`` and the ``prompts`` themselves, save it (weights +
    manifest) to ``out`` and return the manifest. ``extra_manifest`` adds entries."""
    layers = fused_layers(model.config.n_layers)
    sequences = LayerSequences(model, data, context, prompts, layers, config.max_pairs)
    job = FeatureTraining(model, sequences, config, fused=len(layers))

    def step() -> float:
        loss = torch.stack(unrolled_losses(job.drafter, *job.batch(), config.unroll)).mean()
        loss.backward()
        return float(loss.detach())

    def held_out(rows: list[int]) -> dict[str, Any]:
        return evaluate(job.drafter, sequences, rows, config.eval_depth, config.unroll)

    return job.fit_and_save(KIND, step, held_out, out, extra_manifest, progress, list(layers))
