"""Attention kernels (reference PyTorch, fast CPU paths, Triton) behind one public op.

``import genrec_spec.kernels`` never imports triton; the Triton backend loads on first use.
"""

from genrec_spec.kernels.tree_attention import BACKENDS, tree_attention
from genrec_spec.kernels.tree_mask import (
    TreeAttentionError,
    ancestor_bitmask,
    ancestor_mask,
    tree_depths,
)
from genrec_spec.kernels.tree_plan import TreePlan, prepare_tree

__all__ = [
    "BACKENDS",
    "TreeAttentionError",
    "TreePlan",
    "ancestor_bitmask",
    "ancestor_mask",
    "prepare_tree",
    "tree_attention",
    "tree_depths",
]
