"""Acceptance rules: which root-to-node path of a scored draft tree to keep, and the next token.

Each rule is a pure function of (tree, target logits, sampling, generator) with flattened,
batched inputs; terms (accepted / recovered / bonus / next token) are defined in
``genrec_spec.core.types``. Trees arrive already scored, so the target has validated them.

Exactness of ``RejectionSampling`` (recursive rejection sampling, SpecInfer / EAGLE; a chain is
the one-child case, Leviathan et al. / Chen et al.). At the current node let r_1 = p, the
target's processed distribution. Its children x_1..x_m are tried in index order; x_j was drawn
from q_j = draft_probs[x_j] *given the earlier siblings* (the DraftTree contract) and
independently of the verification coins. Child j is accepted with probability
min(1, r_j(x_j) / q_j(x_j)); on rejection r_{j+1} = norm(max(r_j - q_j, 0)). If no child is
accepted (or there is none) the next token is drawn from the last residual. Claim: the emitted
token is distributed as r_j from step j on. Backwards induction: if steps j+1.. emit r_{j+1},
step j emits y with probability min(q_j, r_j)(y) + (1 - sum min(q_j, r_j)) r_{j+1}(y)
= min(q_j, r_j)(y) + max(r_j - q_j, 0)(y) = r_j(y). So the first emitted token is distributed
exactly as p. Given that x_j was emitted, its subtree was drawn from the draft given x_j alone,
so the same argument applies one level down with the target's distribution after x_j.
The sibling cases differ only in q_j, which the proposer supplies:
- i.i.d. siblings (SpecInfer): q_j = q for all j (duplicates are harmless: r_{j+1}(x_j) = 0);
- siblings sampled without replacement: q_j = q with x_1..x_{j-1} removed, renormalised;
- deterministic siblings (top-w, n-gram; draft_probs None): q_j = one-hot(x_j), so x_j is
  accepted with probability r_j(x_j) and rejection zeroes x_j in r (EAGLE's implementation).
Using q_j = q for siblings that were *not* i.i.d. samples is biased; tests/core shows it.
"""

from __future__ import annotations

from typing import ClassVar, Protocol

import torch
from torch import Tensor

from genrec_spec.core.sampling import probabilities, sample
from genrec_spec.core.tree import paths, topology
from genrec_spec.core.types import Acceptance, DraftTree, SamplingParams


class AcceptanceRule(Protocol):
    lossless: ClassVar[bool]  # True: the output is distributed exactly as plain decoding's

    def __call__(
        self,
        tree: DraftTree,  # tokens, parents [B, N]; draft_probs [B, N, V] or None; valid [B, N]
        target_logits: Tensor,  # [B, N, V]: the target's next-token logits after each node
        sampling: SamplingParams,  # shapes the target distribution (as it shaped the draft's)
        generator: torch.Generator | None,  # all randomness (coins, next-token draws)
    ) -> Acceptance: ...


def _finish(
    tree: DraftTree, ancestors: Tensor, depth: Tensor, last: Tensor, next_token: Tensor
) -> Acceptance:
    """Assemble an Acceptance from the deepest kept node last [B] and the next token [B];
    ancestors [B, N, N] and depth [B, N] come from ``genrec_spec.core.tree.topology``."""
    path = paths(ancestors, depth).gather(1, last[:, None, None].expand(-1, 1, tree.num_nodes))
    path = path.squeeze(1)  # [B, N] root .. last, then -1
    num_accepted = depth.gather(1, last[:, None]).squeeze(1)
    on_path = path >= 0
    path = path.clamp_min(0)
    accepted = tree.tokens.gather(1, path)  # [B, N]; column d is the token at depth d
    emitted = torch.cat([accepted[:, 1:], torch.zeros_like(accepted[:, :1])], dim=1)
    emitted = emitted.scatter(1, num_accepted[:, None], next_token[:, None])
    emitted = torch.where(
        torch.arange(tree.num_nodes, device=path.device) <= num_accepted[:, None], emitted, 0
    )
    draft_depth = torch.where(tree.node_valid(), depth, 0).max(-1).values
    return Acceptance(
        path=torch.where(on_path, path, 0),
        tokens=emitted,
        num_accepted=num_accepted,
        next_token=next_token,
        draft_depth=draft_depth,
    )


class GreedyMatch:
    """Keep the longest path whose every token is the target's argmax after its parent
    (earliest node on ties); the next token is the argmax after that path. Lossless for greedy
    decoding: the output equals plain greedy decoding token for token."""

    lossless: ClassVar[bool] = True

    def __call__(
        self,
        tree: DraftTree,
        target_logits: Tensor,
        sampling: SamplingParams,
        generator: torch.Generator | None,
    ) -> Acceptance:
        # tree [B, N], target_logits [B, N, V]
        if tree.num_nodes == 1:  # plain decoding: the root's argmax, without the tree's work
            next_token = target_logits[:, 0].argmax(-1)  # [B]
            none = torch.zeros_like(next_token)
            return Acceptance(
                path=none[:, None],
                tokens=next_token[:, None],
                num_accepted=none,
                next_token=next_token,
                draft_depth=none,
            )
        best = target_logits.argmax(-1)  # [B, N]
        parent_best = best.gather(1, tree.parents.clamp_min(0))
        match = (tree.tokens == parent_best) & tree.node_valid()
        match[:, 0] = True
        # A node is kept when it and all its ancestors match.
        ancestors, depth = topology(tree.parents, validate=False)
        kept = ~(ancestors & ~match[:, None, :]).any(-1)  # [B, N]
        last = torch.where(kept, depth, -1).argmax(-1)  # first index among the deepest kept
        return _finish(tree, ancestors, depth, last, best.gather(1, last[:, None]).squeeze(1))


class RejectionSampling:
    """Recursive rejection sampling over chains and multi-draft trees; exact (see module doc).
    Works for greedy sampling too (one-hot target), where it reduces to GreedyMatch."""

    lossless: ClassVar[bool] = True

    def __call__(
        self,
        tree: DraftTree,
        target_logits: Tensor,
        sampling: SamplingParams,
        generator: torch.Generator | None,
    ) -> Acceptance:
        # tree [B, N] (draft_probs [B, N, V] or None = one-hot), target_logits [B, N, V]
        p = probabilities(target_logits, sampling)  # [B, N, V]
        batch, n, _ = p.shape
        valid = tree.node_valid()
        coins = torch.rand(batch, n, generator=generator, device=p.device)
        current = torch.zeros(batch, dtype=torch.long, device=p.device)
        residual = p[:, 0]  # [B, V] target distribution at the current node, minus rejections
        # One pass in index order: node i is tried iff its parent is the current node. Because
        # parents precede children and siblings are in index order, this visits exactly the
        # children of the current node, in order, and then the children of an accepted child.
        for i in range(1, n):
            token = tree.tokens[:, i : i + 1]  # [B, 1]
            tried = valid[:, i] & (tree.parents[:, i] == current)
            p_token = residual.gather(1, token).squeeze(1)
            if tree.draft_probs is None:
                q_token = torch.ones_like(p_token)
                leftover = residual.scatter(1, token, 0.0)
            else:
                q = tree.draft_probs[:, i].float()
                q_token = q.gather(1, token).squeeze(1)
                leftover = (residual - q).clamp_min(0.0)
            # Strict "<": a token the target gives zero mass is never accepted.
            accept = tried & (coins[:, i] * q_token < p_token)
            mass = leftover.sum(-1, keepdim=True)
            # Zero leftover mass means r == q up to rounding: the rejection had probability 0.
            leftover = torch.where(mass > 0, leftover / mass.clamp_min(1e-30), residual)
            residual = torch.where(
                accept[:, None],
                p[:, i],
                torch.where((tried & ~accept)[:, None], leftover, residual),
            )
            current = torch.where(accept, i, current)
        return _finish(
            tree, *topology(tree.parents, validate=False), current, sample(residual, generator)
        )


class TypicalAcceptance:
    """Medusa's typical acceptance: keep the deepest path whose tokens all have target
    probability above min(epsilon, delta * exp(-entropy)); the next token is sampled from the
    target restricted to that typical set. Fast but NOT lossless."""

    lossless: ClassVar[bool] = False

    def __init__(self, epsilon: float = 0.09, delta: float = 0.3) -> None:
        self.epsilon = epsilon
        self.delta = delta

    def __call__(
        self,
        tree: DraftTree,
        target_logits: Tensor,
        sampling: SamplingParams,
        generator: torch.Generator | None,
    ) -> Acceptance:
        # tree [B, N], target_logits [B, N, V]
        p = probabilities(target_logits, sampling)  # [B, N, V]
        entropy = -(p * p.clamp_min(1e-30).log()).sum(-1)  # [B, N]
        threshold = torch.minimum(
            torch.full_like(entropy, self.epsilon), self.delta * torch.exp(-entropy)
        )
        parents = tree.parents.clamp_min(0)
        at_parent = p.gather(1, parents[:, :, None].expand(-1, -1, p.shape[2]))  # [B, N, V]
        p_token = at_parent.gather(2, tree.tokens[:, :, None]).squeeze(2)  # p(token | parent)
        typical = (p_token >= threshold.gather(1, parents)) & tree.node_valid()
        typical[:, 0] = True
        ancestors, depth = topology(tree.parents, validate=False)
        kept = ~(ancestors & ~typical[:, None, :]).any(-1)
        last = torch.where(kept, depth, -1).argmax(-1)
        at_last = p.gather(1, last[:, None, None].expand(-1, 1, p.shape[2])).squeeze(1)
        cutoff = threshold.gather(1, last[:, None])
        restricted = torch.where(at_last >= cutoff, at_last, 0.0)
        restricted = torch.where(restricted.sum(-1, keepdim=True) > 0, restricted, at_last)
        return _finish(tree, ancestors, depth, last, sample(restricted, generator))
