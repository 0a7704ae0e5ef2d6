"""The public shared-context tree-attention op: checks its input once, then dispatches.

Each of B rows has a root context (a prompt or user history, e.g. the KV cache) and a draft tree
of N nodes. Node i attends to the first ``root_lens[b]`` root keys and to the tree nodes that are
itself or its ancestors, never to siblings or other branches; so one forward pass scores every
branch against the shared root.

Backends (all compute the same function):
- ``"torch"``: the dense-mask reference, the specification (``tree_attention_torch``);
- ``"cpu"``: split attention, root part shared by all nodes, combined by log-sum-exp; plain torch,
  so it runs on any device; what ``"auto"`` picks for CPU tensors;
- ``"triton"``: the Triton kernel (``tree_attention_triton``), imported only when asked for;
  what ``"auto"`` picks for CUDA tensors. On a machine without a GPU it runs in the Triton
  interpreter when ``TRITON_INTERPRET=1`` was set before triton was imported.
"""

import importlib
import os

import torch

from genrec_spec.kernels.tree_attention_torch import (
    tree_attention_reference,
    tree_attention_split,
)
from genrec_spec.kernels.tree_mask import TreeAttentionError

BACKENDS = ("auto", "torch", "cpu", "triton")
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def tree_attention(
    q: torch.Tensor,  # [B, Hq, N, D]
    k_root: torch.Tensor,  # [B, Hkv, S, D]
    v_root: torch.Tensor,  # [B, Hkv, S, D]
    root_lens: torch.Tensor,  # [B] int64, 0 <= root_lens[b] <= S
    k_tree: torch.Tensor,  # [B, Hkv, N, D]
    v_tree: torch.Tensor,  # [B, Hkv, N, D]
    parents: torch.Tensor,  # [B, N] int64, -1 <= parents[b, i] < i
    *,
    scale: float | None = None,
    backend: str = "auto",
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # out [B, Hq, N, D] (, lse [B, Hq, N])
    """Shared-context tree attention.

    Row b's root keys are ``k_root[b, :, :root_lens[b]]`` (the rest is padding, never read by
    the split and Triton paths). Query head h uses KV head ``h // (Hq // Hkv)`` (grouped-query
    attention). ``scale`` defaults to ``D ** -0.5``. Returns the output in q's dtype and, with
    ``return_lse``, the fp32 natural log-sum-exp of each query's scaled scores, which lets a
    caller merge this attention with another over more keys. Raises ``TreeAttentionError`` (a
    ``ValueError``) on inconsistent shapes, dtypes, devices, lengths or parents.
    """
    _check_inputs(q, k_root, v_root, root_lens, k_tree, v_tree, parents, backend)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if backend == "auto":
        backend = "triton" if q.is_cuda else "cpu"
    if backend == "torch":
        impl = tree_attention_reference
    elif backend == "cpu":
        impl = tree_attention_split
    else:
        impl = _triton_impl(q.device)
    out, lse = impl(q, k_root, v_root, root_lens, k_tree, v_tree, parents, scale)
    return (out, lse) if return_lse else out


def _triton_impl(device: torch.device):
    """Import the Triton backend on first use, so ``import genrec_spec.kernels`` never imports
    triton (and the interpreter switch can still be set before it is)."""
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise TreeAttentionError(
            f"backend='triton' got tensors on {device}; compiled Triton kernels run on CUDA only",
            "move the tensors to a CUDA device, use backend='cpu', or set TRITON_INTERPRET=1 "
            "before importing triton to run the kernel in the (slow) interpreter",
        )
    try:
        module = importlib.import_module("genrec_spec.kernels.tree_attention_triton")
    except ImportError as err:
        raise ImportError(
            f"backend='triton' needs the triton package, which failed to import ({err}). "
            "Install it (pip install triton==3.7.1) or use backend='cpu'"
        ) from err
    return module.tree_attention_triton


def _check_inputs(q, k_root, v_root, root_lens, k_tree, v_tree, parents, backend) -> None:
    """Shapes, dtypes, devices and root lengths; ``ancestor_mask`` checks the parents' values."""
    if backend not in BACKENDS:
        raise TreeAttentionError(f"unknown backend {backend!r}", f"use one of {BACKENDS}")
    floats = {"q": q, "k_root": k_root, "v_root": v_root, "k_tree": k_tree, "v_tree": v_tree}
    tensors = {**floats, "root_lens": root_lens, "parents": parents}
    for name, t in floats.items():
        if t.dim() != 4:
            raise TreeAttentionError(
                f"{name} must be 4-D [batch, heads, length, head_dim], got shape {tuple(t.shape)}",
                "lay attention inputs out as [B, H, length, D]",
            )
        if t.dtype not in FLOAT_DTYPES or t.dtype != q.dtype:
            raise TreeAttentionError(
                f"{name} is {t.dtype} but q is {q.dtype}",
                "give q, k_root, v_root, k_tree and v_tree one dtype: float32, float16 or bfloat16",
            )
    for name, t in tensors.items():
        if t.device != q.device:
            raise TreeAttentionError(
                f"{name} is on {t.device} but q is on {q.device}", "put all inputs on one device"
            )
    batch, hq, n, d = q.shape
    hkv, s = k_root.shape[1], k_root.shape[2]
    expected = {
        "k_root": (batch, hkv, s, d),
        "v_root": (batch, hkv, s, d),
        "k_tree": (batch, hkv, n, d),
        "v_tree": (batch, hkv, n, d),
        "root_lens": (batch,),
        "parents": (batch, n),
    }
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise TreeAttentionError(
                f"{name} has shape {tuple(tensors[name].shape)}, expected {shape} from q "
                f"{tuple(q.shape)} and k_root {tuple(k_root.shape)}",
                "q is [B, Hq, N, D], k_root/v_root [B, Hkv, S, D], k_tree/v_tree [B, Hkv, N, D], "
                "root_lens [B], parents [B, N]",
            )
    if hkv == 0 or hq % hkv != 0:
        raise TreeAttentionError(
            f"{hq} query heads cannot share {hkv} KV heads evenly",
            "use a number of query heads that is a multiple of the number of KV heads",
        )
    if n == 0:
        raise TreeAttentionError("the tree has no nodes (N = 0)", "pass at least one tree node")
    if root_lens.dtype.is_floating_point or root_lens.dtype == torch.bool:
        raise TreeAttentionError(
            f"root_lens must be an integer tensor, got {root_lens.dtype}",
            "pass root_lens as int64 lengths of each row's root context",
        )
    if bool(((root_lens < 0) | (root_lens > s)).any()):
        raise TreeAttentionError(
            f"root_lens {root_lens.tolist()} must lie in [0, {s}] (S = k_root.shape[2])",
            "clip each row's root length to the padded root size S",
        )
