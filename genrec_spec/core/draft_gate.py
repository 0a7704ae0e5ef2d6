"""When speculative beam search drafts: while its drafts pay for their nodes.

A pass that carries drafted nodes costs more than a plain one, and pays back in the later steps
that need no pass (every live beam reached a node drafted for it). Over the drafted passes so
far, with counts decayed by ``smoothing`` at each one,

    speedup = (D + S) / (D + E)

D the drafted passes, S the steps they saved, and E the extra cost of their drafted nodes in
units of the pass without them: cost(n + d) / cost(n) - 1 for a pass of n nodes and d drafted
ones, cost the controller's model (a measured ``pass_cost`` table, or ``token_cost``'s line:
``controller.modelled_cost``). The search drafts while the speedup is at least ``min_speedup``,
and otherwise once every ``probe_every`` passes to notice drafts paying again. It starts from
``prior_weight`` drafted passes that each saved a step, so it drafts at first, to measure.

Whether a pass drafts never changes the search's output, only its cost; the decision reads
counts, not clocks, so a run repeats its passes exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

from genrec_spec.core.controller import ControllerConfig, modelled_cost


@dataclass
class DraftGate:
    """Decides, pass by pass, whether the drafter adds nodes (module docstring)."""

    config: ControllerConfig
    drafted: float = 0.0  # D, decayed
    saved: float = 0.0  # S
    extra: float = 0.0  # E
    closed: int = 0  # passes since the gate last opened

    def __post_init__(self) -> None:
        self.drafted = self.saved = self.config.prior_weight

    @property
    def speedup(self) -> float:
        return (self.drafted + self.saved) / (self.drafted + self.extra)

    def opens(self) -> bool:
        """Whether the next pass carries drafts."""
        if not self.config.adaptive or self.speedup >= self.config.min_speedup:
            self.closed = 0
            return True
        self.closed += 1
        return self.closed % self.config.probe_every == 0

    def count_pass(self, nodes: int, drafted: int) -> None:
        """A pass of ``nodes`` nodes besides its ``drafted`` ones (all rows) was planned."""
        if not drafted:
            return
        keep = self.config.smoothing
        plain = max(nodes, 1)
        cost = modelled_cost(self.config, plain + drafted) / modelled_cost(self.config, plain)
        self.drafted = keep * self.drafted + 1
        self.saved = keep * self.saved
        self.extra = keep * self.extra + cost - 1

    def count_saved_step(self) -> None:
        """A step found every live beam's node drafted: no pass."""
        self.saved += 1
