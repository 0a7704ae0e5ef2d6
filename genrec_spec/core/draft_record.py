"""Whether a speculative beam search drafts: by what drafting earned in earlier searches.

A pass that carries drafted nodes costs more than a plain one, and pays back only in the later
steps that need no pass (every live beam reached a node drafted for it). The payoff lags the
cost: in a search over a catalogue of titles, the nodes drafted at a search's first passes are
reached 3-5 passes later, when the beams walk down to them, so a rule that decides pass by pass
inside one search sees the cost before the payoff and stops drafting where it pays best
(docs/results/beam.md, "A per-pass draft gate, tried and reverted"). A ``DraftRecord`` instead
keeps what whole searches earned, across the searches of one drafter on one target (the caller
holds it: a recommender, a service, a benchmark), and decides per search. Over the searches
that drafted, with counts decayed by ``smoothing`` at each,

    speedup = (D + S) / (D + E)

D the passes of those searches (those that drafted nothing too: D + S is what plain beam search
would have made), S the steps that needed no pass, and E the extra cost of the drafted nodes in
units of the pass without them: cost(n + d) / cost(n) - 1 for a pass of n nodes (all rows) and
d drafted ones, cost the controller's model (a measured ``pass_cost`` table, or
``token_cost``'s line: ``controller.modelled_cost``). A search drafts while the speedup is at
least ``min_speedup``, and otherwise one search in ``probe_every``, to notice drafts paying
again. The record starts from ``prior_weight`` passes that each saved a step, so the first
search drafts, to measure.

Whether a search drafts never changes its output, only its cost; the decision reads counts,
not clocks, so a run repeats its passes exactly (given the same cost table: a measured one is
timed once per machine and cached).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from genrec_spec.core.controller import ControllerConfig, modelled_cost


@dataclass
class DraftRecord:
    """What drafting earned over earlier searches (module docstring)."""

    config: ControllerConfig = field(default_factory=ControllerConfig)
    drafted: float = 0.0  # D, decayed per search
    saved: float = 0.0  # S
    extra: float = 0.0  # E
    skipped: int = 0  # searches since the record last let one draft

    def __post_init__(self) -> None:
        self.drafted = self.saved = self.config.prior_weight

    @property
    def speedup(self) -> float:
        return (self.drafted + self.saved) / (self.drafted + self.extra)

    def drafts(self) -> bool:
        """Whether the next search drafts."""
        if not self.config.adaptive or self.speedup >= self.config.min_speedup:
            self.skipped = 0
            return True
        self.skipped += 1
        return self.skipped % self.config.probe_every == 0

    def extra_cost(self, nodes: int, drafted: int) -> float:
        """The extra cost of ``drafted`` nodes in a pass of ``nodes`` others, in passes."""
        plain = max(nodes, 1)
        return modelled_cost(self.config, plain + drafted) / modelled_cost(self.config, plain) - 1

    def count(self, passes: Sequence[tuple[int, int]], saved: int) -> None:
        """A search that drafted: (nodes planned for its beams, nodes drafted) of each of its
        passes (a pass may draft none), and ``saved``, its steps that needed no pass."""
        if not passes:
            return
        keep = self.config.smoothing
        self.drafted = keep * self.drafted + len(passes)
        self.saved = keep * self.saved + saved
        self.extra = keep * self.extra + sum(self.extra_cost(n, d) for n, d in passes)
