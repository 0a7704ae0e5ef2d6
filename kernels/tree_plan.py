"""A tree-attention plan: what every layer's call derives from (parents, root_lens), built once.

A model calls ``tree_attention`` once per layer with the same tree and the same root lengths.
``prepare_tree`` validates them once (the value checks are the op's host syncs) and precomputes
every view of the tree the backends read; ``tree_attention(..., plan=plan)`` then skips all of
that, so a forward pass pays the tree bookkeeping once, not once per layer.

On CPU the plan also picks the CPU path for the shape and dtype (see
``DENSE_MAX_MASK_ELEMENTS`` and ``GATHER_MIN_NODES``) and, for the dense one, prebuilds its
additive mask. The views only some paths read (``visible``, ``depths``, ``ancestors``, the Triton
kernel's ``bits``) are built on first use.

A caller that knows its trees are shallow (a Semantic-ID prefix tree is at most L - 1 code levels
deep) passes ``max_depth``: the plan then walks max_depth steps up the tree from each queried node
(checked: a deeper tree raises at once), and the ancestor mask is those few ancestors scattered,
instead of ceil(log2 N) pointer-doubling steps over [B, N+1, N+1]. A wide shallow tree needs no
mask at all: each query sees its own node and at most max_depth ancestors, which the split path
gathers.
"""

from dataclasses import dataclass
from functools import cached_property

import torch

from genrec_spec.kernels.tree_mask import (
    TreeAttentionError,
    ancestor_mask,
    check_parents,
    pack_bits,
)

# The CPU path for a plan: the dense one (one SDPA call over [root | tree] keys with the plan's
# prebuilt additive mask, GQA without repeated K/V) for float32 while the mask has at most this
# many elements (64 MiB), the split one otherwise. For float32 the dense call is faster than the
# split path's many small ops (most on short roots), more so reading a cache in place; CPU SDPA
# in float16 and bfloat16 is slower than split, so half types keep the split path
# (``genrec-spec bench kernel`` compares them).
DENSE_MAX_MASK_ELEMENTS = 1 << 24
# A shallow tree (``max_depth`` given) of at least this many nodes takes the split path with a
# gathered tree part: each query's own node and ancestors, at most max_depth + 1 keys, instead of
# a product over all N behind a mask, so its cost grows with N, not N^2, and no [B, M, N] mask is
# built. Below it the dense path's one SDPA call costs less. The crossover was measured at batch
# 1 to 64 on three-level prefix trees (docs/results/kernels.md, "Wide shallow trees").
GATHER_MIN_NODES = 300


@dataclass(frozen=True, eq=False)
class TreePlan:
    """Per-forward description of B trees of N nodes over roots padded to S keys.

    Built by ``prepare_tree``; tensors live on the tree's device. ``host_root_lens``,
    ``dense_mask`` and ``root_padding`` exist on CPU only (on a GPU the lengths' host copy
    would be a sync and nothing there reads them); ``depths``, ``ancestors``,
    ``ancestor_rows``, ``bits`` and the dense path's masks are built on first use (pointwise
    attention, which reads ``visible`` or ``ancestor_rows``, never pays for the dense masks or
    the bits)."""

    parents: torch.Tensor  # [B, N] int64, the tensor the plan was built from
    root_lens: torch.Tensor  # [B] int64, the tensor the plan was built from
    root_size: int  # S, the padded root length the lengths were checked against
    dtype: torch.dtype  # the attention inputs' dtype the plan was built for
    queries: int  # M: the queries are the last M of the N tree nodes
    max_depth: int | None  # the most tree ancestors a node has, where the caller promised it
    host_root_lens: tuple[int, ...] | None  # root_lens on the host (CPU only)
    dense: bool  # the CPU's dense path serves this plan (else the split one)
    gather: bool  # the split path gathers each query's ancestors (else masks all N nodes)
    finite_padding: bool  # ``prepare_tree``'s promise: padded root keys hold finite numbers

    @cached_property
    def visible(self) -> torch.Tensor:  # [B, M, N] bool
        """Query i (tree node N - M + i) sees tree node j: j is i or one of its ancestors."""
        n = self.parents.shape[1]
        if self.max_depth is None:  # pointer doubling: log2 N steps, whatever the depth
            return ancestor_mask(self.parents, validate=False)[:, n - self.queries :]
        # each query's few ancestors, scattered; column n catches the -1 past a node's root
        seen = torch.where(self.ancestors >= 0, self.ancestors, n)  # [B, M, A]
        mask = torch.zeros(*seen.shape[:2], n + 1, dtype=torch.bool, device=seen.device)
        return mask.scatter_(2, seen, True)[:, :, :n]

    @property
    def dense_mask(self) -> torch.Tensor | None:  # [B, 1, M, max_len + N]
        """Dense CPU path only (None: take the split path): over keys [root[:max_len] | tree],
        0 where visible and -inf where not."""
        return self._dense_masks[0] if self.dense else None

    @property
    def root_padding(self) -> torch.Tensor | None:  # [B, 1, max_len - min_len, 1] bool
        """Dense path with ragged roots whose padding may be non-finite: True at the padding
        keys among root positions [min_len, max_len), zeroed in the copied keys before SDPA
        reads them."""
        return self._dense_masks[1] if self.dense and not self.finite_padding else None

    @cached_property
    def _dense_masks(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return _dense_masks(self.visible, self.root_lens, self.host_root_lens, self.dtype)

    @cached_property
    def root_visible(self) -> torch.Tensor:  # [B, S] bool: the real root keys of each row
        return torch.arange(self.root_size, device=self.root_lens.device) < self.root_lens[:, None]

    @cached_property
    def depths(self) -> torch.Tensor:  # [B, M] int64: each query's ancestors (position past root)
        return self.visible.sum(dim=-1) - 1

    @cached_property
    def ancestors(self) -> torch.Tensor:  # [B, M, A] int64: the tree nodes each query sees
        """Each query's own node, then its ancestors up the tree, -1 past its root; A is
        max_depth + 1 on a plan that knows it, else the deepest query's depth + 1. The few keys
        a node sees, for attention that gathers them instead of masking all N (``visible`` holds
        the same sets). Walked up from the parents, a step per level (summing ``visible`` for
        the depths costs more on wide trees: it reads all B x M x N entries); with
        ``max_depth``, exactly that many steps and one host sync, which raises where a queried
        node has more ancestors."""
        batch, n = self.parents.shape
        node = torch.arange(n - self.queries, n, device=self.parents.device).expand(batch, -1)
        chain = [node]
        while True:
            node = torch.where(node >= 0, self.parents.gather(1, node.clamp_min(0)), -1)
            if self.max_depth is None:  # a host sync a level, up to the deepest query's root
                if not bool((node >= 0).any()):
                    return torch.stack(chain, dim=2)
            elif len(chain) > self.max_depth:  # max_depth steps taken: nothing may be left
                if bool((node >= 0).any()):
                    raise TreeAttentionError(
                        f"a tree node has more than max_depth = {self.max_depth} ancestors",
                        "pass the trees' true maximum depth as max_depth, or None",
                    )
                return torch.stack(chain, dim=2)
            chain.append(node)

    @cached_property
    def ancestor_rows(self) -> tuple[torch.Tensor, torch.Tensor]:  # [B, M, A] int64, bool
        """``ancestors`` as rows of the tree flattened to [B * N] (row b's node j is b * N + j;
        -1 entries read row b's node 0) and which of them are real: what a gather over every
        layer's keys reads, made once a pass."""
        batch, n = self.parents.shape
        rows = torch.arange(batch, device=self.parents.device)[:, None, None] * n
        return self.ancestors.clamp_min(0) + rows, self.ancestors >= 0

    @cached_property
    def bits(
        self,
    ) -> torch.Tensor:  # [B, M, W] int32: ``visible`` packed 32 nodes per word (Triton)
        return pack_bits(self.visible)

    @property
    def max_root_len(self) -> int:  # CPU only
        return max(self.host_root_lens)

    @property
    def min_root_len(self) -> int:  # CPU only
        return min(self.host_root_lens)


def prepare_tree(
    parents: torch.Tensor,  # [B, N] int64, -1 <= parents[b, i] < i
    root_lens: torch.Tensor,  # [B] int64, 0 <= root_lens[b] <= root_size
    root_size: int,  # S = k_root.shape[2], the padded root length
    *,
    dtype: torch.dtype = torch.float32,
    finite_padding: bool = False,
    max_depth: int | None = None,
    queries: int | None = None,
) -> TreePlan:
    """Validate a tree and its root lengths once and precompute what ``tree_attention`` needs.

    ``dtype`` is the attention inputs' dtype (the dense CPU path serves float32 only). With
    ``finite_padding=True`` the caller promises that padded root keys/values (positions past a
    row's length) hold finite numbers, as a zero-initialised KV cache that only ever receives
    model outputs does: the dense CPU path may then read them under its -inf mask (weight
    exactly 0) instead of zeroing them in a copy, which lets it read a cache in place. Without
    the promise padding may hold anything, NaN included.

    ``max_depth``: no node has more than this many tree ancestors (checked for the queried
    nodes: a deeper one raises); the plan then walks up from each queried node, and a wide tree
    takes the gathering split path (module docstring).

    ``queries``: M, when only the last M nodes of the tree are queried (None: all N). The
    earlier nodes' K/V were computed by earlier passes and are only keys now: a tree grown a
    few nodes per pass (beam search) pays attention for its new nodes alone.

    Raises ``TreeAttentionError`` on bad shapes or values (one host sync each on a GPU)."""
    _check_tree_inputs(parents, root_lens, root_size)
    check_parents(parents)
    if bool(((root_lens < 0) | (root_lens > root_size)).any()):
        raise TreeAttentionError(
            f"root_lens {root_lens.tolist()} must lie in [0, {root_size}] (S = k_root.shape[2])",
            "clip each row's root length to the padded root size S",
        )
    n = parents.shape[1]
    queries = n if queries is None else queries
    if not 1 <= queries <= n:
        raise TreeAttentionError(
            f"queries = {queries} must lie in [1, N = {n}]", "query at least one tree node"
        )
    gather = max_depth is not None and n >= GATHER_MIN_NODES
    host_lens, dense = None, False
    if parents.device.type == "cpu":
        host_lens = tuple(root_lens.tolist())  # free on CPU
        mask_elements = parents.shape[0] * queries * (max(host_lens) + n)
        dense = dtype == torch.float32 and mask_elements <= DENSE_MAX_MASK_ELEMENTS and not gather
    plan = TreePlan(
        parents=parents,
        root_lens=root_lens,
        root_size=root_size,
        dtype=dtype,
        queries=queries,
        max_depth=max_depth,
        host_root_lens=host_lens,
        dense=dense,
        gather=gather,
        finite_padding=finite_padding,
    )
    if max_depth is not None:
        # Walked now (and kept for the paths that read it): the walk checks the promised depth,
        # so a deeper tree fails here, not inside a layer.
        _ = plan.ancestors
    return plan


def _dense_masks(
    visible: torch.Tensor,  # [B, M, N] bool
    root_lens: torch.Tensor,  # [B] int64
    host_lens: tuple[int, ...],
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # [B, 1, M, max + N], [B, 1, max - min, 1]
    """The dense path's additive mask over [root[:max] | tree] keys, and its padding mask."""
    batch, m, n = visible.shape
    low, high = min(host_lens), max(host_lens)
    root_visible = torch.arange(high, device=visible.device) < root_lens[:, None]  # [B, max]
    keys_visible = torch.cat([root_visible[:, None, :].expand(batch, m, high), visible], dim=2)
    mask = torch.zeros(batch, 1, m, high + n, dtype=dtype, device=visible.device)
    mask.masked_fill_(~keys_visible[:, None], float("-inf"))
    padding = ~root_visible[:, None, low:, None] if low < high else None
    return mask, padding


def _check_tree_inputs(parents: torch.Tensor, root_lens: torch.Tensor, root_size: int) -> None:
    """Shapes, dtypes and devices of a tree and its root lengths (no values: no host sync)."""
    if root_lens.dtype.is_floating_point or root_lens.dtype == torch.bool:
        raise TreeAttentionError(
            f"root_lens must be an integer tensor, got {root_lens.dtype}",
            "pass root_lens as int64 lengths of each row's root context",
        )
    if parents.dim() != 2 or tuple(root_lens.shape) != (parents.shape[0],):
        raise TreeAttentionError(
            f"parents has shape {tuple(parents.shape)} and root_lens {tuple(root_lens.shape)}, "
            "expected [B, N] and [B]",
            "pass one tree (parents [B, N]) and one root length per row",
        )
    if parents.shape[1] == 0:
        raise TreeAttentionError("the tree has no nodes (N = 0)", "pass at least one tree node")
    if root_lens.device != parents.device:
        raise TreeAttentionError(
            f"root_lens is on {root_lens.device} but parents is on {parents.device}",
            "put all inputs on one device",
        )
    if root_size < 0:
        raise TreeAttentionError(
            f"root_size {root_size} is negative", "pass k_root.shape[2] as root_size"
        )
