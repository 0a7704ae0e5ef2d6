"""Self-distillation data for trained drafters: the target's own greedy continuations of the
train-split prompts, with its last hidden state at every generated position.

Layout (ragged, one row per prompt): row r holds positions ``offsets[r] .. offsets[r + 1] - 1``.
``tokens[j]`` is the token the target generated at position j and ``hidden[j]`` the target's
final-normed hidden state (its LM head's input, hidden layer ``n_layers``) at the position
before it, so ``LM_head(hidden[j])`` argmaxes to ``tokens[j]``: the row's first entry sits on
the prompt's last token. A drafter predicting k tokens further learns
``hidden[j] -> tokens[j + k]`` within a row.

Continuations come from the project's ``generate`` (plain greedy, batched, stopping at eos),
and the hidden states from the same decode steps (a recorder in the proposer's seat reads
``cache.hidden`` after every step; no second forward). The result is cached as one file,
``<cache>/drafters/selfdistill/<key>.safetensors``, the key hashing the target's fingerprint,
the prompt token ids and the settings; it is written under a temporary name and renamed.

Drafters that attend to the context (EAGLE) also read the prompts' own pairs in the same layout,
teacher-forced: ``hidden[j]`` is the target's state at prompt position t = 0 .. L - 2 and
``tokens[j]`` the prompt token at t + 1 (not the target's choice), so a row's prompt pairs
followed by its continuation pairs are one sequence. One prefill per batch of prompts, cached
as ``prompts-<key>.safetensors`` (key: target fingerprint and prompt ids).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor
from tqdm import tqdm

from genrec_spec.core.decode import generate
from genrec_spec.core.tree import root_only
from genrec_spec.core.types import Acceptance, DecodeState, DraftTree
from genrec_spec.llm.training.checkpoint import target_info, write_atomically

VERSION = 1  # bumped when the data layout or its generation changes


@dataclass(frozen=True)
class SelfDistillConfig:
    """Which prompts the target continues, and how."""

    # Corpora of genrec_spec.llm.prompts; "NAME:N" draws N prompts of NAME instead of n. The
    # default: all 123 of HumanEval's train prompts (train-drafter gives EAGLE and EAGLE-3
    # more: its KIND_PROMPTS). Debian's fortunes add prose ("fortunes:N") where that package
    # is installed.
    sources: tuple[str, ...] = ("humaneval:123",)
    n: int = 64  # prompts drawn from each source without its own :N
    max_new_tokens: int = 128  # continuation length (shorter where the target emits eos)
    batch_size: int = 16  # rows per generate() call (batched by prompt length)
    seed: int = 0  # which train prompts are drawn


@dataclass(frozen=True)
class SelfDistillData:
    hidden: Tensor  # [S, D] float32, the state before tokens[j]
    tokens: Tensor  # [S] int64, the target's greedy token
    offsets: Tensor  # [R + 1] int64, row r is [offsets[r], offsets[r + 1])
    key: str  # the cache key (names the data in drafter manifests)

    @property
    def rows(self) -> int:
        return len(self.offsets) - 1


def train_prompts(tokenizer: Any, config: SelfDistillConfig) -> list[list[int]]:
    """Token ids of ``config.n`` (or the entry's own N) train-split prompts of each source
    (chat sources wrapped in the tokenizer's chat template), as the benchmark tokenizes its
    bench-split prompts."""
    from genrec_spec.llm.prompts import load_prompts, source_and_count

    texts = [
        text
        for entry in config.sources
        for text in load_prompts(
            *source_and_count(entry, config.n), config.seed, "train", tokenizer
        )
    ]
    return [tokenizer(text)["input_ids"] for text in texts]


class _HiddenRecorder:
    """A proposer that never drafts (k = 0), so decoding stays plain: after every step it keeps
    the target's hidden state at each row's root, the state the step's token came from."""

    k, draft_cost = 0, 0.0

    def __init__(self, layer: int) -> None:
        self.hidden_layers = (layer,)

    def begin(self, state: DecodeState) -> None:
        self.hidden: list[Tensor] = []  # per step [B, D]
        self.emitted: list[Tensor] = []  # per step [B] bool, rows that emitted a token

    def propose(self, state: DecodeState, budget: int) -> DraftTree:
        return root_only(state.roots)  # (never asked: k = 0 keeps the budget at 0)

    def observe(self, state: DecodeState, acceptance: Acceptance) -> None:
        self.hidden.append(state.cache.hidden[self.hidden_layers[0]][:, 0])
        self.emitted.append(state.counts > 0)


def _length_batches(prompts: list[list[int]], batch_size: int) -> list[list[int]]:
    """Row indices in batches of similar prompt lengths: a batch's prefill costs its longest
    prompt on every row, so sorting mixed-length prompts saves most of the padding."""
    order = sorted(range(len(prompts)), key=lambda r: len(prompts[r]))
    return [order[start : start + batch_size] for start in range(0, len(order), batch_size)]


def distill(
    model: Any,
    prompts: list[list[int]],
    max_new_tokens: int,
    batch_size: int,
    eos_token_id: int | None = None,
    progress: bool = True,
) -> tuple[Tensor, Tensor, Tensor]:
    """Continue every prompt greedily with the native Llama ``model``; returns hidden [S, D],
    tokens [S] and offsets [R + 1] in the layout of the module docstring."""
    recorder = _HiddenRecorder(model.config.n_layers)
    hidden_rows: list[Tensor] = [torch.empty(0)] * len(prompts)  # per row [G, D]
    token_rows: list[Tensor] = [torch.empty(0)] * len(prompts)  # per row [G]
    bar = tqdm(total=len(prompts), desc="self-distill", unit="prompt", disable=not progress)
    for rows in _length_batches(prompts, batch_size):
        out = generate(
            model,
            [prompts[r] for r in rows],
            max_new_tokens=max_new_tokens,
            eos_token_id=eos_token_id,
            proposer=recorder,
        )
        hidden = torch.stack(recorder.hidden, dim=1).float()  # [B, steps, D]
        emitted = torch.stack(recorder.emitted, dim=1)  # [B, steps]
        for b, (row, continuation) in enumerate(zip(rows, out.tolist(), strict=True)):
            hidden_rows[row] = hidden[b, emitted[b]]
            token_rows[row] = torch.tensor(continuation, dtype=torch.long)
        bar.update(len(rows))
    bar.close()
    sizes = torch.tensor([0] + [len(row) for row in token_rows])
    return torch.cat(hidden_rows), torch.cat(token_rows), sizes.cumsum(0)


def data_key(
    model: Any, prompts: list[list[int]], max_new_tokens: int, eos_token_id: int | None
) -> str:
    """What the data depends on: the target, the prompt ids and the generation settings."""
    settings = {
        "version": VERSION,
        "target": target_info(model)["fingerprint"],
        "prompts": hashlib.sha256(json.dumps(prompts).encode()).hexdigest(),
        "max_new_tokens": max_new_tokens,
        "eos_token_id": eos_token_id,
    }
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:20]


def prompt_pairs(
    model: Any, prompts: list[list[int]], batch_size: int
) -> tuple[Tensor, Tensor, Tensor]:
    """The prompts' teacher-forced pairs (module docstring): hidden [P, D] float32, tokens [P]
    and offsets [R + 1]; a one-token prompt has none."""
    layer = model.config.n_layers
    hidden_rows: list[Tensor] = [torch.empty(0)] * len(prompts)  # per row [L - 1, D]
    token_rows: list[Tensor] = [torch.empty(0)] * len(prompts)  # per row [L - 1]
    for rows in _length_batches(prompts, batch_size):
        width = max(len(prompts[r]) for r in rows)
        ids = torch.tensor([prompts[r] + [0] * (width - len(prompts[r])) for r in rows])  # [B, T]
        hidden = model.hidden_states(ids, model.new_cache(len(rows), width), (layer,))
        for b, r in enumerate(rows):
            hidden_rows[r] = hidden[layer][b, : len(prompts[r]) - 1].float()
            token_rows[r] = torch.tensor(prompts[r][1:], dtype=torch.long)
    sizes = torch.tensor([0] + [len(row) for row in token_rows])
    return torch.cat(hidden_rows), torch.cat(token_rows), sizes.cumsum(0)


def _load_or_build(
    path: Path, key: str, build: Callable[[], tuple[Tensor, Tensor, Tensor]]
) -> SelfDistillData:
    """The data cached at ``path``, built (``build() -> (hidden, tokens, offsets)``) and written
    atomically first when missing."""
    if not path.is_file():
        hidden, tokens, offsets = build()
        tensors = {"hidden": hidden, "tokens": tokens, "offsets": offsets}
        write_atomically(path, lambda tmp: save_file(tensors, str(tmp), metadata={"key": key}))
    tensors = load_file(str(path))
    return SelfDistillData(tensors["hidden"], tensors["tokens"], tensors["offsets"], key)


def _folder(cache_dir: str | Path | None) -> Path:
    """``cache_dir`` None means ``$GENREC_SPEC_CACHE`` or ``~/.cache/genrec_spec``."""
    from genrec_spec.cache import cache_dir as default_cache_dir

    return Path(cache_dir or default_cache_dir()) / "drafters" / "selfdistill"


def load_or_distill(
    model: Any,
    prompts: list[list[int]],
    max_new_tokens: int,
    batch_size: int,
    eos_token_id: int | None = None,
    cache_dir: str | Path | None = None,
    progress: bool = True,
) -> SelfDistillData:
    """The cached data for these prompts and settings, generated first when missing."""
    key = data_key(model, prompts, max_new_tokens, eos_token_id)
    return _load_or_build(
        _folder(cache_dir) / f"{key}.safetensors",
        key,
        lambda: distill(model, prompts, max_new_tokens, batch_size, eos_token_id, progress),
    )


def load_or_prefill(
    model: Any, prompts: list[list[int]], batch_size: int, cache_dir: str | Path | None = None
) -> SelfDistillData:
    """The prompts' cached teacher-forced pairs (``prompt_pairs``), computed first when
    missing; rows in the order of ``prompts``, as in ``load_or_distill``."""
    settings = {
        "version": VERSION,
        "target": target_info(model)["fingerprint"],
        "prompts": hashlib.sha256(json.dumps(prompts).encode()).hexdigest(),
    }
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:20]
    return _load_or_build(
        _folder(cache_dir) / f"prompts-{key}.safetensors",
        key,
        lambda: prompt_pairs(model, prompts, batch_size),
    )
