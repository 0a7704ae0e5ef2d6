"""The types every decoding method shares: draft trees, acceptance results, sampling settings,
decode statistics, and the mutable per-call decode state that proposers and targets read.

Terms used across the core (as in vLLM's rejection sampler):
- *accepted tokens*: draft tokens the acceptance rule kept, a root-to-node path of the tree;
- *recovered token*: the token sampled from the residual distribution at the first rejection;
- *bonus token*: the token sampled from the target after a fully accepted path (no child left);
- *next token*: the recovered or bonus token; it becomes the next root.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from genrec_spec.errors import GenrecError


class DecodeInputError(GenrecError):
    """Bad input to the decoding core (prompts, sampling settings, proposer or target options)."""


@dataclass(frozen=True)
class SamplingParams:
    """How next-token distributions are shaped, applied identically to target and draft.

    temperature: 0 means greedy (argmax); > 0 divides the logits.
    top_k: keep the k most likely tokens; 0 keeps all.
    top_p: keep the smallest set of most likely tokens whose mass reaches top_p; 1 keeps all.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.temperature < math.inf:  # (inf would sample uniformly: no model)
            raise DecodeInputError(
                f"temperature must be finite and >= 0, got {self.temperature}",
                "pass temperature=0 for greedy decoding or a positive value for sampling",
            )
        if self.top_k < 0:
            raise DecodeInputError(
                f"top_k must be >= 0, got {self.top_k}", "pass top_k=0 to keep every token"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise DecodeInputError(
                f"top_p must lie in (0, 1], got {self.top_p}", "pass top_p=1.0 to disable top-p"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class DraftTree:
    """A batch of draft trees in topological order (every parent index < its child's index).

    Node 0 of every row is the root: the last committed token, not yet scored by the target.
    Children of one parent are tried in index order by the acceptance rule.

    draft_probs[b, i] is the distribution node i was drawn from, *conditioned on its ancestors
    and on its earlier siblings*: for children sampled i.i.d. it is the parent's draft
    distribution q; for children sampled without replacement it is q with the earlier siblings
    removed and renormalised. ``None`` means a deterministic drafter: every node's distribution
    is one-hot on its own token (n-gram, lookahead, top-w children, argmax heads).
    """

    tokens: Tensor  # [B, N] int64
    parents: Tensor  # [B, N] int64, parents[:, 0] == -1
    draft_probs: Tensor | None = None  # [B, N, V] float
    valid: Tensor | None = None  # [B, N] bool; False marks padding nodes acceptance never takes

    def __post_init__(self) -> None:
        if self.tokens.shape != self.parents.shape or self.tokens.dim() != 2:
            raise DecodeInputError(
                f"tokens {tuple(self.tokens.shape)} and parents {tuple(self.parents.shape)} "
                "must both be [B, N]",
                "build trees with genrec_spec.core.tree helpers",
            )

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]

    def node_valid(self) -> Tensor:  # [B, N] bool
        if self.valid is None:
            return torch.ones_like(self.tokens, dtype=torch.bool)
        return self.valid


@dataclass(frozen=True)
class Acceptance:
    """What the acceptance rule kept from one scored tree (see the module docstring for terms).

    path[b, :num_accepted[b] + 1] are the node indices root, accepted_1, ..., accepted_n: the
    nodes whose K/V the target commits. tokens[b, :num_accepted[b] + 1] are the emitted tokens:
    the accepted tokens followed by the next token. Entries past those lengths are 0.
    """

    path: Tensor  # [B, N] int64 node indices
    tokens: Tensor  # [B, N] int64 emitted tokens
    num_accepted: Tensor  # [B] int64
    next_token: Tensor  # [B] int64, the recovered or bonus token
    draft_depth: Tensor  # [B] int64, depth of the row's deepest valid draft node (0: no draft)


@dataclass(frozen=True)
class DecodeStats:
    """Counters of one generate() call. A row-step is one active row in one target forward."""

    # Forwards of the target that scored next tokens: its tree passes, and a prefill that
    # scored the prompts' last tokens (``scores_prefill``); a prefill that did not is not counted
    target_forwards: int
    speculative_forwards: int  # of those, forwards that scored a proposer's tree
    generated_tokens: int  # tokens returned over all rows
    row_steps: int  # active (row, forward) pairs
    drafted_per_position: tuple[int, ...]  # [K] row-steps whose tree reached depth k + 1
    accepted_per_position: tuple[int, ...]  # [K] row-steps that accepted a token at depth k + 1
    wall_time_s: float  # prefill + decoding, measured around the whole call
    nodes_scored: int = 0  # real tree nodes over all forwards (beam search reports it)
    draft_nodes: int = 0  # of those, nodes a drafter proposed (beam search reports it)
    # Beam search with a drafter: the beams' nodes (roots excluded) whose next-token scores
    # selection read from the target, and how many of them a drafter had proposed
    needed_nodes: int = 0
    draft_hits: int = 0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per row per target forward (accepted + the next token); plain
        decoding gives 1.0."""
        return self.generated_tokens / max(self.row_steps, 1)

    @property
    def acceptance_rate_per_position(self) -> tuple[float, ...]:
        return tuple(
            a / max(d, 1)
            for a, d in zip(self.accepted_per_position, self.drafted_per_position, strict=True)
        )

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / max(self.wall_time_s, 1e-9)

    def as_dict(self) -> dict[str, Any]:
        return {
            "target_forwards": self.target_forwards,
            "speculative_forwards": self.speculative_forwards,
            "generated_tokens": self.generated_tokens,
            "row_steps": self.row_steps,
            "mean_accepted_length": self.mean_accepted_length,
            "drafted_per_position": list(self.drafted_per_position),
            "accepted_per_position": list(self.accepted_per_position),
            "wall_time_s": self.wall_time_s,
            "tokens_per_second": self.tokens_per_second,
            "nodes_scored": self.nodes_scored,
            "draft_nodes": self.draft_nodes,
            "needed_nodes": self.needed_nodes,
            "draft_hits": self.draft_hits,
        }


@dataclass(frozen=True)
class Generation:
    """Generated tokens per row, ragged: row b is values[offsets[b]:offsets[b + 1]]."""

    values: Tensor  # [sum of lengths] int64
    offsets: Tensor  # [B + 1] int64, offsets[0] == 0
    stats: DecodeStats

    def tolist(self) -> list[list[int]]:
        values, offsets = self.values.tolist(), self.offsets.tolist()
        return [values[offsets[b] : offsets[b + 1]] for b in range(len(offsets) - 1)]


def write_ragged(buffer: Tensor, lengths: Tensor, values: Tensor, counts: Tensor) -> Tensor:
    """Copy of buffer [B, T] with values[b, :counts[b]] written at buffer[b, lengths[b]:];
    values [B, M], lengths [B], counts [B]. Caller guarantees lengths + counts <= T."""
    width = values.shape[1]
    columns = lengths[:, None] + torch.arange(width, device=buffer.device)
    # Entries past counts are sent to a scratch column that is cut off afterwards.
    columns = torch.where(
        torch.arange(width, device=buffer.device) < counts[:, None], columns, buffer.shape[1]
    )
    padded = torch.cat([buffer, buffer.new_zeros(buffer.shape[0], 1)], dim=1)
    return padded.scatter(1, columns, values)[:, :-1]


@dataclass
class DecodeState:
    """Mutable state of one generate() call, read by proposers and targets.

    tokens holds prompt + generated tokens, right-padded with 0; the root of row b (last
    committed token, not yet scored) is tokens[b, lengths[b] - 1]. Finished rows are frozen:
    they still ride in the batch but emit and commit nothing.
    """

    tokens: Tensor  # [B, T] int64
    lengths: Tensor  # [B] int64
    prompt_lengths: Tensor  # [B] int64
    finished: Tensor  # [B] bool
    sampling: SamplingParams
    generator: torch.Generator | None
    vocab_size: int
    max_new_tokens: int
    cache: Any = None  # the target's cache handle; exposes .hidden after score_tree
    tree: DraftTree | None = None  # the tree scored in the last step
    logits: Tensor | None = None  # [B, N, V] target logits of that tree
    counts: Tensor | None = None  # [B] tokens emitted per row in the last step
    speculated: bool = False  # whether the last tree came from the proposer

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def roots(self) -> Tensor:  # [B]
        return self.tokens.gather(1, (self.lengths - 1)[:, None]).squeeze(1)


class Proposer(Protocol):
    """A drafter: n-gram, lookahead, draft model; later Medusa / EAGLE / MTP heads. It keeps
    its own per-call state (reset by ``begin``) and may read ``state.cache.hidden`` (the
    target's hidden states of the last scored tree, for the layers in ``hidden_layers``)."""

    k: int  # deepest draft it makes: the controller's ceiling for the budget
    draft_cost: float  # cost of one draft level relative to one target forward (0: model-free)
    hidden_layers: tuple[int, ...]  # target layers whose hidden states it reads (usually ())

    def begin(self, state: DecodeState) -> None: ...

    def propose(self, state: DecodeState, budget: int) -> DraftTree:
        """A tree rooted at state.roots whose nodes are at most ``budget`` deep."""
        ...

    def observe(self, state: DecodeState, acceptance: Acceptance) -> None:
        """Called after every step, speculative or not (state.speculated tells which)."""
        ...
