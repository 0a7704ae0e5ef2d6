"""How deep to draft each step, and when not to speculate at all.

The model (deterministic, so seeded runs stay reproducible; no wall-clock timing while decoding;
a measured ``pass_cost`` table makes the depths, and so which random draws a sampled run makes,
depend on the machine the table was timed on: ``cached_pass_cost`` times it once per machine,
so seeded runs there repeat):
- tokens per row per step with draft depth k and per-token acceptance a: 1 + a + ... + a^m
  (geometric: the path survives each further draft token with probability a), where
  m = reach * k is the depth the drafter actually reaches (an n-gram drafter often finds
  shorter continuations, or none);
- cost of a step relative to a plain decoding step: the target forward grows with the tokens it
  scores, cost(B * (1 + n_k)) / cost(B), with B the batch size and n_k the tree's nodes below
  the root; plus ``draft_cost * k`` for drafters that run a model once per draft level. cost(n)
  is ``pass_cost``, a measured table (``measure_pass_cost``: on a CPU it is far from linear, a
  few tokens costing little more than one; ``cached_pass_cost`` keeps it per model shape and
  machine), or else the linear
  model 1 + c * n with c = ``token_cost``, the cost of one more token relative to the forward's
  fixed cost.
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

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from genrec_spec.core.targets import as_target
from genrec_spec.core.types import DecodeInputError, DraftTree
from genrec_spec.data_pipelines.atomic import json_made_once
from genrec_spec.machine import finish, machine_key, time_in_turns


@dataclass(frozen=True)
class ControllerConfig:
    adaptive: bool = True  # False: always draft to the proposer's full depth k
    # Cost of one more scored token / fixed cost of a forward: a small model on CPU; on a GPU
    # it is lower.
    token_cost: float = 0.1
    # Measured cost of a forward over n = 1, 2, ... scored tokens (all rows) relative to one
    # (``measure_pass_cost``); extended past its end at its average slope. Empty: token_cost.
    pass_cost: tuple[float, ...] = ()
    smoothing: float = 0.8  # decay per step of the acceptance counts (weight of the past)
    prior_acceptance: float = 0.6  # acceptance assumed before any evidence ...
    prior_weight: float = 2.0  # ... worth this many accepted-or-rejected draft tokens
    min_speedup: float = 1.05  # speculate only when the modelled speedup exceeds this
    probe_every: int = 8  # while off, speculate once every this many steps


def modelled_cost(config: ControllerConfig, scored: float) -> float:
    """Modelled cost of a forward over ``scored`` tokens, in the units of ``config.pass_cost``
    (a one-token forward = 1) or of the linear model."""
    table = config.pass_cost
    if not table:
        return 1 + config.token_cost * scored
    if scored <= len(table):  # between measured sizes: interpolate
        low = max(int(scored), 1)
        high = min(low + 1, len(table))
        return table[low - 1] + (scored - low) * (table[high - 1] - table[low - 1])
    slope = (table[-1] - table[0]) / max(len(table) - 1, 1)
    return table[-1] + (scored - len(table)) * slope


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
        batch, a = self.batch_size, self.acceptance
        depth = self.reach * k
        tokens = depth + 1 if a >= 1 else (1 - a ** (depth + 1)) / (1 - a)
        forward = self.pass_cost(batch * (1 + self.nodes_per_level * k)) / self.pass_cost(batch)
        return tokens / (forward + self.draft_cost * k)

    def pass_cost(self, scored: float) -> float:
        return modelled_cost(self.config, scored)

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


@torch.no_grad()
def measure_pass_cost(
    model: Any, max_tokens: int = 16, context: int = 128, repeats: int = 5
) -> tuple[float, ...]:  # cost of a forward over n = 1 .. max_tokens tokens / over 1
    """Time ``model``'s forward (any target ``generate`` takes) over a chain of n = 1 ..
    ``max_tokens`` nodes after a ``context``-token prompt, one row; medians of ``repeats`` after
    a warm-up, relative to n = 1. For ``ControllerConfig.pass_cost``; run with the threads and
    load decoding will see."""
    target = as_target(model)
    grown = max_tokens * (repeats + 2)  # each pass commits its root; the last adds max_tokens
    context = min(context, target.max_length - grown)  # a short model keeps a shorter prompt
    if context < 1:
        raise DecodeInputError(
            f"a target of max length {target.max_length} cannot time {max_tokens} tokens",
            "pass a smaller max_tokens or repeats",
        )
    on = getattr(target, "device", "cpu")
    prompt = torch.ones(1, context, dtype=torch.long, device=on)  # its content: no matter
    capacity = context + grown
    cache = target.prefill(prompt, torch.tensor([context], device=on), capacity)
    root = torch.zeros(1, 1, dtype=torch.long, device=on)
    trees = [
        DraftTree(
            torch.ones(1, n, dtype=torch.long, device=on),
            torch.arange(-1, n - 1, device=on)[None],
        )
        for n in range(1, max_tokens + 1)
    ]
    keep_root = torch.ones(1, dtype=torch.long, device=on)
    seconds = time_in_turns(
        {
            n: (lambda tree=tree: finish(target.score_tree(cache, tree).device))
            for n, tree in enumerate(trees, 1)
        },
        repeats,
        after=lambda n: target.commit(cache, root, keep_root),  # keep the root only
    )
    return tuple(seconds[n] / seconds[1] for n in range(1, max_tokens + 1))


# Part of cached_pass_cost's key: bump it when the targets' kernels change what a pass of n
# tokens costs (3: models/llm/cpu_linear chooses each product's path by measurement).
PASS_COST_KERNELS = 3


def cached_pass_cost(model: Any, folder: Path | None = None) -> tuple[float, ...]:
    """``measure_pass_cost(model)``, timed once per model shape and machine and kept in
    ``folder`` (default ``$GENREC_SPEC_CACHE/pass_cost``): the table depends on the weights'
    shapes, the thread count, the CPU or GPU, the torch build and our kernels
    (``PASS_COST_KERNELS``), not on the weights' values, so those make the key. A cache file
    that cannot be read is timed again and replaced."""
    if folder is None:
        from genrec_spec.cache import cache_dir

        folder = cache_dir() / "pass_cost"
    record = json_made_once(
        Path(folder) / f"{_machine_key(model)}.json",
        lambda: {"pass_cost": measure_pass_cost(model), "measured": time.time()},
        valid=lambda record: [float(c) for c in record["pass_cost"]][:1] == [1.0],
    )
    return tuple(float(c) for c in record["pass_cost"])


def _machine_key(model: Any) -> str:
    """A digest of what a forward's timing depends on (see ``cached_pass_cost``)."""
    if not isinstance(model, torch.nn.Module):
        raise DecodeInputError(
            f"cached_pass_cost keys its cache on a torch module's weight shapes, got "
            f"{type(model).__name__}",
            "pass the model itself, or time a wrapped target with measure_pass_cost",
        )
    parameters = list(model.parameters())
    device = parameters[0].device if parameters else torch.device("cpu")
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    shapes = [(tuple(p.shape), str(p.dtype)) for p in parameters]
    return machine_key(
        type(model).__qualname__,
        shapes,
        torch.get_num_threads(),
        device.type,
        gpu,
        PASS_COST_KERNELS,
    )
