"""The public shared-context tree-attention op: checks its input once, then dispatches.

Each of B rows has a root context (a prompt or user history, e.g. the KV cache) and a draft tree
of N nodes. Node i attends to the first ``root_lens[b]`` root keys and to the tree nodes that are
itself or its ancestors, never to siblings or other branches; so one forward pass scores every
branch against the shared root.

A model calling the op once per layer builds a ``TreePlan`` once per forward
(``prepare_tree``) and passes it as ``plan=``: the validation (host syncs) and the tree's masks
are then paid once per pass, not once per layer.

Backends (all compute the same function):
- ``"torch"``: the dense-mask reference, the specification (``tree_attention_torch``);
- ``"cpu"``: what ``"auto"`` picks for CPU tensors; plain torch, so it runs on any device. For
  float32 up to a mask size (the plan decides, ``tree_plan.DENSE_MAX_MASK_ELEMENTS``) one SDPA
  call over [root | tree] keys with the plan's additive mask; otherwise (and whenever the
  log-sum-exp is asked for) split attention: the root part shared by all nodes, the tree
  part with the ancestor mask, or, for a wide tree of known small depth
  (``tree_plan.GATHER_MIN_NODES``), over each node's own ancestors gathered; combined by
  log-sum-exp;
- ``"triton"``: the Triton kernel (``tree_attention_triton``), imported only when asked for;
  what ``"auto"`` picks for CUDA tensors. On a machine without a GPU it runs in the Triton
  interpreter when ``TRITON_INTERPRET=1`` was set before triton was imported.
"""

import importlib
import os

import torch

from genrec_spec.kernels.tree_attention_torch import (
    tree_attention_dense,
    tree_attention_reference,
    tree_attention_split,
)
from genrec_spec.kernels.tree_mask import TreeAttentionError
from genrec_spec.kernels.tree_plan import TreePlan, prepare_tree

BACKENDS = ("auto", "torch", "cpu", "triton")
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def tree_attention(
    q: torch.Tensor,  # [B, Hq, M, D] the queries of the last M tree nodes (M = N usually)
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
    plan: TreePlan | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # out [B, Hq, M, D] (, lse [B, Hq, M])
    """Shared-context tree attention.

    Row b's root keys are ``k_root[b, :, :root_lens[b]]``; the rest is padding and may hold
    anything, NaN included (the split and Triton paths never read it, the dense CPU path zeroes
    it in its copy of the keys, or reads it under a -inf mask when the plan was built with
    ``finite_padding=True``). Query head h uses KV head ``h // (Hq // Hkv)`` (grouped-query
    attention). ``scale`` defaults to ``D ** -0.5``. Returns the output in q's dtype and, with
    ``return_lse``, the fp32 natural log-sum-exp of each query's scaled scores, which lets a
    caller merge this attention with another over more keys. Raises ``TreeAttentionError`` (a
    ``ValueError``) on inconsistent shapes, dtypes, devices, lengths or parents.

    q may query only the last M < N nodes (a tree grown by earlier passes, whose K/V are in
    k_tree already): the plan must then be built with ``queries=M``.

    ``plan``: ``prepare_tree(parents, root_lens, S, dtype=q.dtype)`` built from these very
    ``parents`` and ``root_lens`` tensors, typically once per forward pass for all layers. With
    it, the parents' and lengths' values are not checked again (no host sync); shapes are.
    """
    _check_inputs(q, k_root, v_root, k_tree, v_tree, parents, backend)
    if plan is None:
        plan = prepare_tree(parents, root_lens, k_root.shape[2], dtype=q.dtype, queries=q.shape[2])
    else:
        _check_plan(plan, q, parents, root_lens, k_root)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if backend == "auto":
        backend = "triton" if q.is_cuda else "cpu"
    if backend == "cpu" and plan.dense_mask is not None and not return_lse:
        return tree_attention_dense(q, k_root, v_root, k_tree, v_tree, plan, scale)
    if backend == "torch":
        impl = tree_attention_reference
    elif backend == "cpu":
        impl = tree_attention_split
    else:
        impl = _triton_impl(q.device)
    out, lse = impl(q, k_root, v_root, k_tree, v_tree, plan, scale)
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


def _check_inputs(q, k_root, v_root, k_tree, v_tree, parents, backend) -> None:
    """Shapes, dtypes and devices of the attention inputs (no values: no host sync);
    ``prepare_tree`` checks root_lens and the parents' values."""
    if backend not in BACKENDS:
        raise TreeAttentionError(f"unknown backend {backend!r}", f"use one of {BACKENDS}")
    floats = {"q": q, "k_root": k_root, "v_root": v_root, "k_tree": k_tree, "v_tree": v_tree}
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
    for name, t in {**floats, "parents": parents}.items():
        if t.device != q.device:
            raise TreeAttentionError(
                f"{name} is on {t.device} but q is on {q.device}", "put all inputs on one device"
            )
    batch, hq, m, d = q.shape
    hkv, s, n = k_root.shape[1], k_root.shape[2], parents.shape[-1]
    if parents.dim() != 2 or not 1 <= m <= n:
        raise TreeAttentionError(
            f"q has {m} queries and parents shape {tuple(parents.shape)}: q must query the last "
            "M nodes of a [B, N] tree, 1 <= M <= N",
            "pass parents [B, N] and q [B, Hq, M, D]",
        )
    expected = {
        "k_root": (k_root, (batch, hkv, s, d)),
        "v_root": (v_root, (batch, hkv, s, d)),
        "k_tree": (k_tree, (batch, hkv, n, d)),
        "v_tree": (v_tree, (batch, hkv, n, d)),
        "parents": (parents, (batch, n)),
    }
    for name, (t, shape) in expected.items():
        if t.shape != shape:
            raise TreeAttentionError(
                f"{name} has shape {tuple(t.shape)}, expected {shape} from q "
                f"{tuple(q.shape)} and k_root {tuple(k_root.shape)}",
                "q is [B, Hq, M, D], k_root/v_root [B, Hkv, S, D], k_tree/v_tree [B, Hkv, N, D], "
                "root_lens [B], parents [B, N]",
            )
    if hkv == 0 or hq % hkv != 0:
        raise TreeAttentionError(
            f"{hq} query heads cannot share {hkv} KV heads evenly",
            "use a number of query heads that is a multiple of the number of KV heads",
        )


def _check_plan(plan, q, parents, root_lens, k_root) -> None:
    """A plan fits only the tensors it was built from (identity: comparing values would sync)."""
    if plan.parents is not parents or plan.root_lens is not root_lens:
        raise TreeAttentionError(
            "the plan was built from other parents / root_lens tensors than the ones passed",
            "build it with prepare_tree(parents, root_lens, S) from the tensors you pass",
        )
    if plan.queries != q.shape[2]:
        raise TreeAttentionError(
            f"the plan was built for {plan.queries} queries but q has {q.shape[2]}",
            "pass queries=q.shape[2] to prepare_tree",
        )
    if plan.dtype != q.dtype:
        raise TreeAttentionError(
            f"the plan was built for {plan.dtype} inputs but q is {q.dtype}",
            "pass dtype=q.dtype to prepare_tree",
        )
    if plan.root_size != k_root.shape[2]:
        raise TreeAttentionError(
            f"the plan was built for roots padded to S = {plan.root_size}, but k_root has "
            f"S = {k_root.shape[2]}",
            "pass k_root.shape[2] as prepare_tree's root_size",
        )
