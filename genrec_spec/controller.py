"""How deep to draft each step, and when not to speculate at all.

The model (deterministic, so seeded runs stay reproducible; no wall-clock timing):
- tokens per row per step with draft depth k and per-token acceptance a: 1 + a + ... + a^m
  (geometric: the path survives each further draft token with probability a), where
  m = reach * k is the depth the drafter actually reaches (an n-gram drafter often finds
  shorter continuations, or none);
- cost of a step relative to a plain decoding step: the target forward grows with the tokens it
  scores, (1 + c * B * (1 + n_k)) / (1 + c * B), where c = ``token_cost`` is the cost of one
  more token relative to the forward's fixed cost, B the batch size and n_k the tree's nodes
  below the root; plus ``draft_cost * k`` for drafters that run a model once per draft level.
The first step drafts at full depth to measure; then each step drafts to the depth
k <= proposer.k with the best modelled speedup, or not at all when no depth beats
``min_speedup``; so speculation switches itself off for large batches
(scoring B * n tokens no longer hides behind the fixed cost) and for low acceptance. While off
it probes again every ``probe_every`` steps to notice acceptance coming back.

The acceptance a is a running estimate, accepted / (accepted + rejections) over exponentially
decayed counts of accepted draft tokens and of rejections (a rejection is a row whose path
stopped before its tree's deepest draft): the maximum-likelihood estimate for a geometric law,
started from a prior worth ``prior_weight`` pseudo-observations.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ControllerConfig:
    adaptive: bool = True  # False: always draft to the proposer's full depth k
    # Cost of one more scored token / fixed cost of a forward. 0.1 fits a small model on CPU
    # (8 tokens cost ~2x one, 64 ~5x); on a GPU it is nearer 0.01.
    token_cost: float = 0.1
    smoothing: float = 0.8  # decay per step of the acceptance counts (weight of the past)
    prior_acceptance: float = 0.6  # acceptance assumed before any evidence ...
    prior_weight: float = 2.0  # ... worth this many accepted-or-rejected draft tokens
    min_speedup: float = 1.05  # speculate only when the modelled speedup exceeds this
    probe_every: int = 8  # while off, speculate once every this many steps


class SpeculationController:
    """Chooses each step's draft depth (its ``budget``) from the running acceptance."""

    def __init__(
        self, config: ControllerConfig, k_max: int, draft_cost: float, batch_size: int
    ) -> None:
        self.config = config
        self.k_max = k_max
        self.draft_cost = draft_cost
        self.batch_size = batch_size
        self.accepted = config.prior_weight * config.prior_acceptance  # decayed counts
        self.rejected = config.prior_weight * (1 - config.prior_acceptance)
        # Learnt from the trees seen: nodes per unit of budget, and the fraction of the budget
        # the average row's draft reaches.
        self.nodes_per_level = 1.0
        self.reach = 1.0
        self.last_depth = k_max
        self.steps_off = 0
        self.measured = False  # no speculative step seen yet: draft once at full depth

    @property
    def acceptance(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def speedup(self, k: int) -> float:
        """Modelled tokens per unit cost at draft depth k, relative to plain decoding."""
        c, batch, a = self.config.token_cost, self.batch_size, self.acceptance
        depth = self.reach * k
        tokens = depth + 1 if a >= 1 else (1 - a ** (depth + 1)) / (1 - a)
        forward = (1 + c * batch * (1 + self.nodes_per_level * k)) / (1 + c * batch)
        return tokens / (forward + self.draft_cost * k)

    def budget(self) -> int:
        if self.k_max == 0 or not self.config.adaptive or not self.measured:
            return self.k_max
        best = max(range(self.k_max + 1), key=self.speedup)
        if best > 0 and self.speedup(best) >= self.config.min_speedup:
            self.steps_off = 0
            self.last_depth = best
            return best
        self.steps_off += 1
        return self.last_depth if self.steps_off % self.config.probe_every == 0 else 0

    def update(
        self,
        budget: int,
        num_nodes: int,
        rows: int,
        drafted: float,
        accepted: float,
        rejected: float,
    ) -> None:
        """Record one step: its budget and tree size, and over its `rows` active rows the sum
        of their draft depths, the accepted draft tokens and the rejections."""
        if budget == 0 or rows == 0:
            return
        self.measured = True
        keep = self.config.smoothing
        self.accepted = keep * self.accepted + accepted
        self.rejected = keep * self.rejected + rejected
        self.nodes_per_level = keep * self.nodes_per_level + (1 - keep) * (num_nodes - 1) / budget
        self.reach = keep * self.reach + (1 - keep) * drafted / (rows * budget)
