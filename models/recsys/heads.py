"""Draft heads on the recommender's last history state, for the fast decoders.

All three read h, the backbone's final hidden state of the last history token ([..., D]), the
same state that predicts code level 0:

- `ParallelLevelHeads` (PinRec-style): every code level independently from h, in one pass; an
  item's score is the sum of its levels' log-probabilities.
- `LongIdHeads` (RPG-style multi-token prediction): one head per digit of the long
  product-quantised ID; digits are independent given h, an item's score is the sum of its digits'
  log-probabilities.
- `RecurrentDraftHead` (NEZHA-style): a GRU cell started from h that reads the previous code and
  predicts the next level, so a beam over codes costs one backbone pass plus tiny GRU steps.
  Level 0 comes from the backbone itself (its level-0 log-probs are free in the same pass).

Shape letters: D model width, L code levels, V codes per level, Q long-ID digits, I items.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from genrec_spec.models.derived import DerivedCache
from genrec_spec.models.recsys.errors import RecommenderInputError


def children_log_softmax(logits: Tensor) -> Tensor:  # [..., V] -> [..., V]
    """log_softmax over the finite entries (a prefix's children); a row with none (a prefix no
    item has, a padding beam) gets all -inf, not NaN."""
    log_probs = logits.log_softmax(dim=-1)
    return log_probs.masked_fill(log_probs.isnan(), float("-inf"))


def _padded_log_softmax(logits: Tensor, sizes: list[int]) -> Tensor:
    """log_softmax over the first sizes[j] entries of logits[..., j, :]; -inf past them.
    logits: [..., J, Vmax] -> [..., J, Vmax]."""
    if min(sizes) == logits.shape[-1]:  # nothing to mask (e.g. PQ digits of one size)
        return logits.log_softmax(dim=-1)
    width = torch.arange(logits.shape[-1], device=logits.device)  # [Vmax]
    real = width[None, :] < torch.tensor(sizes, device=logits.device)[:, None]  # [J, Vmax]
    return logits.masked_fill(~real, float("-inf")).log_softmax(dim=-1)


_INCIDENCE = DerivedCache()  # item code table -> its sparse code incidence matrix


def _code_incidence(item_codes: Tensor, vmax: int) -> Tensor:
    """[I, J] codes -> sparse CSR [I, J * vmax] with a 1 at j * vmax + code[i, j] for each
    position j of item i (columns rise within a row, as CSR wants); float32, as its products
    (`_incidence_product`)."""

    def build() -> Tensor:
        items, positions = item_codes.shape
        columns = item_codes + torch.arange(positions, device=item_codes.device) * vmax  # [I, J]
        rows = torch.arange(0, items * positions + 1, positions, device=item_codes.device)
        ones = torch.ones(items * positions, device=item_codes.device)
        with warnings.catch_warnings():  # "CSR support is in beta": products are all we use
            warnings.filterwarnings("ignore", "Sparse CSR tensor support is in beta")
            return torch.sparse_csr_tensor(
                rows, columns.flatten(), ones, (items, positions * vmax), check_invariants=True
            )

    return _INCIDENCE.get(item_codes, (item_codes,), build, extra=vmax)


def _sum_of_code_scores(
    log_probs: Tensor,  # [B, J, Vmax] per-position log-probs of J code positions
    item_codes: Tensor,  # [I, J] int64 codes of every item
) -> Tensor:  # [B, I]
    """Item score = sum over its J positions of log p(code): one sparse product with the items'
    code incidence matrix (J nonzeros per item): several times faster than gathering [B, I] per
    position, forward and backward (the gather's backward is an indexed accumulate)."""
    incidence = _code_incidence(item_codes, log_probs.shape[-1])
    return _incidence_product(incidence, log_probs.flatten(1).T).T


def _incidence_product(incidence: Tensor, dense: Tensor) -> Tensor:  # [I, C] @ [C, N] -> [I, N]
    """A code incidence matrix's product, in fp32 under bf16 autocast too: the sparse product
    has no bf16 CPU kernel, and sums of log-probs would lose their ranks in bf16."""
    with torch.autocast(dense.device.type, enabled=False):
        return incidence @ dense.float()


def _code_cross_entropy(
    log_probs: Tensor,  # [M, J, Vmax]
    targets: Tensor,  # [M, J] int64
) -> Tensor:  # [] mean over the J positions of the per-position mean CE
    return F.nll_loss(log_probs.flatten(0, 1), targets.flatten())


def _catalogue_cross_entropy(
    log_probs: Tensor,  # [M, J, Vmax]
    item_codes: Tensor,  # [I, J] int64 codes of every item
    items: Tensor,  # [M] int64 target items
) -> Tensor:  # [] mean CE of the target item over the whole catalogue
    """Cross-entropy of the decoder's own item score (the sum of the item's code log-probs)
    softmaxed over the catalogue. Per-code cross-entropy fits each position's marginal; this
    fits the ranking the decoder reads (the per-position normalisers are one constant per row,
    so the softmax is over summed code logits)."""
    return F.cross_entropy(_sum_of_code_scores(log_probs, item_codes), items)


class _IndependentCodeHeads(nn.Module):
    """Heads whose J code positions are independent given h (`log_probs`); an item's score is
    the sum of its positions' log-probabilities."""

    def log_probs(self, h: Tensor) -> Tensor:  # h: [..., D] -> [..., J, Vmax], -inf padded
        raise NotImplementedError

    def loss(self, h: Tensor, codes: Tensor) -> Tensor:  # h: [M, D], codes: [M, J] -> []
        return _code_cross_entropy(self.log_probs(h), codes)

    def catalogue_loss(self, h: Tensor, item_codes: Tensor, items: Tensor) -> Tensor:
        # h: [M, D], item_codes: [I, J], items: [M] -> []
        return _catalogue_cross_entropy(self.log_probs(h), item_codes, items)

    def score_items(self, h: Tensor, item_codes: Tensor) -> Tensor:
        # h: [B, D], item_codes: [I, J] -> [B, I] sum of code log-probs
        return _sum_of_code_scores(self.log_probs(h), item_codes)


class ParallelLevelHeads(_IndependentCodeHeads):
    """PinRec-style: one small MLP per code level, all levels from h at once."""

    def __init__(self, dim: int, codebook_sizes: list[int]) -> None:
        super().__init__()
        self.codebook_sizes = list(codebook_sizes)
        self.mlp = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.Linear(dim, size))
            for size in self.codebook_sizes
        )

    def log_probs(self, h: Tensor) -> Tensor:  # h: [..., D] -> [..., L, Vmax], -inf padded
        vmax = max(self.codebook_sizes)
        logits = [F.pad(mlp(h), (0, vmax - mlp[-1].out_features)) for mlp in self.mlp]
        return _padded_log_softmax(torch.stack(logits, dim=-2), self.codebook_sizes)


class LongIdHeads(_IndependentCodeHeads):
    """RPG-style: Q independent digit classifiers from h through one shared projection."""

    def __init__(self, dim: int, digit_sizes: list[int]) -> None:
        super().__init__()
        self.digit_sizes = list(digit_sizes)
        self.vmax = max(self.digit_sizes)
        self.proj = nn.Sequential(nn.Linear(dim, dim), nn.GELU())
        self.out = nn.Linear(dim, len(self.digit_sizes) * self.vmax)

    def log_probs(self, h: Tensor) -> Tensor:  # h: [..., D] -> [..., Q, Vmax], -inf padded
        logits = self.out(self.proj(h)).unflatten(-1, (len(self.digit_sizes), self.vmax))
        return _padded_log_softmax(logits, self.digit_sizes)

    def item_table(self, item_codes: Tensor) -> tuple[Tensor, Tensor]:
        # item_codes: [I, Q] -> (vectors [I, D], biases [I])
        """Every item's summed digit rows and biases of the output layer: an item's summed digit
        logits are <proj(h), vectors[i]> + biases[i] (`recsys.rpg` scores items with it)."""
        incidence = _code_incidence(item_codes, self.vmax)  # [I, Q*Vmax]
        vectors = _incidence_product(incidence, self.out.weight)
        return vectors, _incidence_product(incidence, self.out.bias[:, None])[:, 0]

    def catalogue_loss(self, h: Tensor, item_codes: Tensor, items: Tensor) -> Tensor:
        # h: [M, D], item_codes: [I, Q], items: [M] -> []
        """The base class's loss without the Q x V logits: the per-digit normalisers are one
        constant per row, which the catalogue softmax drops, so it is a softmax over [M, I]
        summed digit logits from `item_table`, built once per step. Same loss and gradients,
        several times faster forward + backward at thousands of states."""
        vectors, biases = self.item_table(item_codes)
        return F.cross_entropy(self.proj(h) @ vectors.T + biases, items)


class RecurrentDraftHead(nn.Module):
    """NEZHA-style autoregressive draft head: a GRU cell over code embeddings, started from h.

    `init(h)` gives the draft state; `step(state, codes, level)` reads the level-`level` code of
    each prefix and returns the new state and the log-probs of level `level + 1`. Leading
    dimensions are free, so a decoder can run B users x K beams at once.
    """

    def __init__(self, dim: int, codebook_sizes: list[int], hidden: int) -> None:
        super().__init__()
        self.codebook_sizes = list(codebook_sizes)
        self.start = nn.Linear(dim, hidden)
        # Codes of levels 0..L-2 are read (the last level is only predicted).
        self.embed = nn.ModuleList(nn.Embedding(v, hidden) for v in self.codebook_sizes[:-1])
        self.cell = nn.GRUCell(hidden, hidden)
        # out[l] predicts level l + 1.
        self.out = nn.ModuleList(nn.Linear(hidden, v) for v in self.codebook_sizes[1:])

    def init(self, h: Tensor) -> Tensor:  # h: [..., D] -> [..., Hd]
        return torch.tanh(self.start(h))

    def step(
        self,
        state: Tensor,  # [..., Hd]
        codes: Tensor,  # [...] int64 level-`level` code of each prefix
        level: int,  # 0..L-2
        item_logits: Tensor | None = None,  # [..., V] added to the head's logits (draft_tied)
    ) -> tuple[Tensor, Tensor]:  # (new state [..., Hd], log-probs of level + 1 [..., V])
        if not 0 <= level < len(self.embed):
            raise RecommenderInputError(
                f"draft step level {level} out of range: the head reads levels "
                f"0..{len(self.embed) - 1} and predicts the next one",
                f"step at a level in 0..{len(self.embed) - 1}",
            )
        lead = codes.shape
        new = self.cell(
            self.embed[level](codes).reshape(-1, state.shape[-1]),
            state.reshape(-1, state.shape[-1]),
        )
        new = new.reshape(*lead, -1)
        logits = self.out[level](new)
        if item_logits is None:
            return new, logits.log_softmax(dim=-1)
        return new, children_log_softmax(logits + item_logits)

    def loss(
        self,
        h: Tensor,  # [M, D]
        codes: Tensor,  # [M, L]
        item_logits: list[Tensor] | None = None,  # per level 1..L-1: [M, V_level] (`step`)
    ) -> Tensor:  # []
        """Teacher-forced mean CE of levels 1..L-1."""
        state, losses = self.init(h), []
        for level in range(len(self.embed)):
            extra = None if item_logits is None else item_logits[level]
            state, log_probs = self.step(state, codes[:, level], level, extra)
            losses.append(F.nll_loss(log_probs, codes[:, level + 1]))
        return torch.stack(losses).mean()
