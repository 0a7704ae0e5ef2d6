"""Shared-context tree attention as one Triton kernel.

One program owns one (row b, KV head) pair and a block of tree nodes; its query rows are all the
G query heads of that KV head times the block's nodes (GQA without repeating K/V). It streams the
row's root keys once for all those rows, then the tree keys up to its last node, masked by each
node's ancestor bitmask (``TreePlan.bits``: 32 nodes per int32 word, so one word is
one 32-key step), with an online softmax in fp32.

Imported only by ``tree_attention`` when the Triton backend is asked for. Under the interpreter
(``TRITON_INTERPRET=1`` before triton is imported) operands are upcast to fp32 before ``tl.dot``:
the interpreter's bf16 dot returns garbage.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton import knobs

from genrec_spec.kernels.tree_mask import BITS_PER_WORD
from genrec_spec.kernels.tree_plan import TreePlan

INTERPRETED = knobs.runtime.interpret
LOG2E = 1.4426950408889634
LN2 = tl.constexpr(0.6931471805599453)  # a constexpr so the kernel may read it
MIN_DOT_ROWS = 16  # tl.dot needs at least 16 rows


@dataclass(frozen=True)
class TritonTreeConfig:
    """Launch parameters of the kernel."""

    block_rows: int = 64  # query rows (G heads x nodes) per program; 64 suits one MMA tile
    block_root: int = 64  # root keys per step of the root loop
    num_warps: int = 4
    num_stages: int = 2


@triton.jit
def _softmax_step(m, l, acc, s, v, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr):
    """Fold one block of base-2 scores s [R, C] and values v [C, D] into the running max m [R],
    sum l [R] and unnormalised output acc [R, D]."""
    m_new = tl.maximum(m, tl.max(s, 1))
    # A row that has seen no visible key yet has m_new = -inf: shift by 0 so exp2 gives 0, not NaN.
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - shift)
    p = tl.exp2(s - shift[:, None])
    l = l * alpha + tl.sum(p, 1)
    if DOT_FP32:
        pv = tl.dot(p, v.to(tl.float32), input_precision=PRECISION)
    else:
        pv = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l, acc * alpha[:, None] + pv


@triton.jit
def _tree_attention_kernel(
    Q, K_ROOT, V_ROOT, K_TREE, V_TREE, ROOT_LENS, ANC, OUT, LSE,
    sq_b, sq_h, sq_n,
    skr_b, skr_h, skr_s,
    svr_b, svr_h, svr_s,
    skt_b, skt_h, skt_n,
    svt_b, svt_h, svt_n,
    sa_b, sa_n,
    so_b, so_h, so_n,
    n_nodes, n_kv_heads, head_dim, scale_log2e,
    GROUP: tl.constexpr, GROUP_P2: tl.constexpr, BLOCK_NODES: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, WORD: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    node_block = tl.program_id(0)
    b = (tl.program_id(1) // n_kv_heads).to(tl.int64)  # int64: b * stride can pass 2^31
    kv = tl.program_id(1) % n_kv_heads
    # Row r of this program is query head kv * G + r // BLOCK_NODES at node r % BLOCK_NODES.
    rows = tl.arange(0, GROUP_P2 * BLOCK_NODES)
    g = rows // BLOCK_NODES
    node = node_block * BLOCK_NODES + rows % BLOCK_NODES
    row_ok = (g < GROUP) & (node < n_nodes)
    head = kv * GROUP + g
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim

    q_ptrs = Q + b * sq_b + head[:, None] * sq_h + node[:, None] * sq_n + d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    m = tl.full([GROUP_P2 * BLOCK_NODES], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_P2 * BLOCK_NODES], tl.float32)
    acc = tl.zeros([GROUP_P2 * BLOCK_NODES, BLOCK_D], tl.float32)

    # Root context: each key block is loaded once for every query row of the program.
    root_len = tl.load(ROOT_LENS + b)
    cols = tl.arange(0, BLOCK_S)
    for start in range(0, root_len, BLOCK_S):
        key = start + cols
        kd_ok = (key < root_len)[:, None] & d_ok[None, :]
        k = tl.load(K_ROOT + b * skr_b + kv * skr_h + key[:, None] * skr_s + d[None, :], kd_ok)
        v = tl.load(V_ROOT + b * svr_b + kv * svr_h + key[:, None] * svr_s + d[None, :], kd_ok)
        if DOT_FP32:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2e
        s = tl.where((key < root_len)[None, :], s, float("-inf"))
        m, l, acc = _softmax_step(m, l, acc, s, v, DOT_FP32, PRECISION)

    # Tree nodes: an ancestor's index is below its descendant's, so keys past this block's last
    # node are never visible; one bitmask word covers one WORD-key step.
    bit = tl.arange(0, WORD)
    tree_end = tl.minimum(n_nodes, (node_block + 1) * BLOCK_NODES)
    for start in range(0, tree_end, WORD):
        key = start + bit
        kd_ok = (key < n_nodes)[:, None] & d_ok[None, :]
        k = tl.load(K_TREE + b * skt_b + kv * skt_h + key[:, None] * skt_n + d[None, :], kd_ok)
        v = tl.load(V_TREE + b * svt_b + kv * svt_h + key[:, None] * svt_n + d[None, :], kd_ok)
        if DOT_FP32:
            k = k.to(tl.float32)
        word = tl.load(ANC + b * sa_b + node * sa_n + start // WORD, mask=row_ok, other=0)
        visible = ((word[:, None] >> bit[None, :]) & 1) != 0
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2e
        s = tl.where(visible, s, float("-inf"))
        m, l, acc = _softmax_step(m, l, acc, s, v, DOT_FP32, PRECISION)

    # Only padding rows (no node, or a head past G) can end with l = 0; they are not stored.
    l = tl.where(l > 0, l, 1.0)
    out = acc / l[:, None]
    o_ptrs = OUT + b * so_b + head[:, None] * so_h + node[:, None] * so_n + d[None, :]
    tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    lse = (m + tl.log2(l)) * LN2  # base 2 -> natural log
    tl.store(LSE + (b * n_kv_heads * GROUP + head) * n_nodes + node, lse, mask=row_ok)


def tree_attention_triton(
    q: torch.Tensor,  # [B, Hq, N, D]
    k_root: torch.Tensor,  # [B, Hkv, S, D]
    v_root: torch.Tensor,  # [B, Hkv, S, D]
    k_tree: torch.Tensor,  # [B, Hkv, N, D]
    v_tree: torch.Tensor,  # [B, Hkv, N, D]
    plan: TreePlan,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # out [B, Hq, N, D], lse [B, Hq, N] fp32
    """The Triton backend of ``tree_attention`` (inputs already validated)."""
    return launch_tree_attention(
        q, k_root, v_root, plan.root_lens, k_tree, v_tree, plan.bits, scale
    )


def launch_tree_attention(
    q: torch.Tensor,  # [B, Hq, N, D]
    k_root: torch.Tensor,  # [B, Hkv, S, D]
    v_root: torch.Tensor,  # [B, Hkv, S, D]
    root_lens: torch.Tensor,  # [B] int64
    k_tree: torch.Tensor,  # [B, Hkv, N, D]
    v_tree: torch.Tensor,  # [B, Hkv, N, D]
    bits: torch.Tensor,  # [B, N, W] int32 from ancestor_bitmask
    scale: float,
    config: TritonTreeConfig = TritonTreeConfig(),
) -> tuple[torch.Tensor, torch.Tensor]:  # out [B, Hq, N, D], lse [B, Hq, N] fp32
    """Launch the kernel on a prebuilt ancestor bitmask (what the benchmark times). Any strides
    work as long as the head dim is contiguous, so a slice of a larger KV cache is read in place."""
    batch, hq, n, d = q.shape
    hkv = k_root.shape[1]
    group = hq // hkv
    q, k_root, v_root, k_tree, v_tree = (
        t if t.stride(-1) == 1 else t.contiguous() for t in (q, k_root, v_root, k_tree, v_tree)
    )
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty(batch, hq, n, dtype=torch.float32, device=q.device)

    group_p2 = triton.next_power_of_2(group)
    block_nodes = min(triton.next_power_of_2(n), max(1, config.block_rows // group_p2))
    block_nodes = max(block_nodes, MIN_DOT_ROWS // group_p2)
    grid = (triton.cdiv(n, block_nodes), batch * hkv)
    _tree_attention_kernel[grid](
        q, k_root, v_root, k_tree, v_tree, root_lens, bits, out, lse,
        q.stride(0), q.stride(1), q.stride(2),
        k_root.stride(0), k_root.stride(1), k_root.stride(2),
        v_root.stride(0), v_root.stride(1), v_root.stride(2),
        k_tree.stride(0), k_tree.stride(1), k_tree.stride(2),
        v_tree.stride(0), v_tree.stride(1), v_tree.stride(2),
        bits.stride(0), bits.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        n, hkv, d, scale * LOG2E,
        GROUP=group, GROUP_P2=group_p2, BLOCK_NODES=block_nodes,
        BLOCK_S=config.block_root, BLOCK_D=max(16, triton.next_power_of_2(d)),
        WORD=BITS_PER_WORD, DOT_FP32=INTERPRETED,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return out, lse
