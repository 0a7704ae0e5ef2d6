"""Attention kernels (reference PyTorch, fast CPU path, Triton) behind one public op.

``import genrec_spec.kernels`` never imports triton; the Triton backend loads on first use.
"""

from genrec_spec.kernels.tree_attention import BACKENDS, tree_attention
from genrec_spec.kernels.tree_mask import (
    TreeAttentionError,
    ancestor_bitmask,
    ancestor_mask,
    tree_depths,
)

__all__ = [
    "BACKENDS",
    "TreeAttentionError",
    "ancestor_bitmask",
    "ancestor_mask",
    "tree_attention",
    "tree_depths",
]
