"""Shared-context tree attention as one Triton kernel.

One program owns one (row b, KV head) pair, a block of tree nodes and a slice of the root; its
query rows are all the G query heads of that KV head times the block's nodes (GQA without
repeating K/V). It streams its root slice once for all those rows and, in the last slice's
program, the tree keys up to its last node, masked by each node's ancestor bitmask
(``TreePlan.bits``: 32 nodes per int32 word, so one word is one 32-key step), with an online
softmax in fp32.

Why slices: a draft tree has few nodes, so (row, KV head, node block) programs alone leave most
of a GPU idle while each walks the whole root in sequence (B=32, 8/2 heads, 64 nodes: 256
programs, 32 dependent steps over a 2048-key root). Splitting the root over more programs, as
flash-decoding does, shortens that chain; each slice writes its partial output and log-sum-exp
and a second small kernel merges them (exact: softmax over a union of key sets).

Imported only by ``tree_attention`` when the Triton backend is asked for. Under the interpreter
(``TRITON_INTERPRET=1`` before triton is imported) operands are upcast to fp32 before ``tl.dot``:
the interpreter's bf16 dot returns garbage.
"""

import functools
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
MERGE_ROWS = 32  # output rows per program of the slice merge


@dataclass(frozen=True)
class TritonTreeConfig:
    """Launch parameters of the kernel."""

    block_rows: int = 64  # query rows (G heads x nodes) per program; 64 suits one MMA tile
    block_root: int = 64  # root keys per step of the root loop
    num_warps: int = 4
    num_stages: int = 3
    # Root slices per (row, KV head, node block); None picks enough to give every SM
    # `programs_per_sm` programs, each slice at least `min_slice` keys long: slices pay off while
    # programs are fewer than the SMs, and cost a merge otherwise.
    root_splits: int | None = None
    programs_per_sm: int = 1
    min_slice: int = 256


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
    PART_OUT, PART_LSE,
    n_nodes, n_queries, n_kv_heads, head_dim, scale_log2e, slice_len,
    GROUP: tl.constexpr, GROUP_P2: tl.constexpr, BLOCK_NODES: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, WORD: tl.constexpr, SPLITS: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    node_block = tl.program_id(0)
    split = tl.program_id(2)
    b = (tl.program_id(1) // n_kv_heads).to(tl.int64)  # int64: b * stride can pass 2^31
    kv = tl.program_id(1) % n_kv_heads
    # Row r of this program is query head kv * G + r // BLOCK_NODES at query r % BLOCK_NODES;
    # the queries are the last n_queries tree nodes, so query i is tree node first + i.
    rows = tl.arange(0, GROUP_P2 * BLOCK_NODES)
    g = rows // BLOCK_NODES
    query = node_block * BLOCK_NODES + rows % BLOCK_NODES
    first = n_nodes - n_queries
    row_ok = (g < GROUP) & (query < n_queries)
    head = kv * GROUP + g
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim

    q_ptrs = Q + b * sq_b + head[:, None] * sq_h + query[:, None] * sq_n + d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    m = tl.full([GROUP_P2 * BLOCK_NODES], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_P2 * BLOCK_NODES], tl.float32)
    acc = tl.zeros([GROUP_P2 * BLOCK_NODES, BLOCK_D], tl.float32)

    # This program's root slice: each key block is loaded once for every query row. slice_len is
    # a multiple of BLOCK_S, so no block straddles two slices.
    root_len = tl.load(ROOT_LENS + b)
    slice_end = tl.minimum(root_len, (split + 1) * slice_len)
    cols = tl.arange(0, BLOCK_S)
    for start in range(split * slice_len, slice_end, BLOCK_S):
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
    # The last slice's program takes them (0 steps elsewhere).
    bit = tl.arange(0, WORD)
    tree_end = tl.minimum(n_nodes, first + (node_block + 1) * BLOCK_NODES)
    tree_end = tl.where(split == SPLITS - 1, tree_end, 0)
    for start in range(0, tree_end, WORD):
        key = start + bit
        kd_ok = (key < n_nodes)[:, None] & d_ok[None, :]
        k = tl.load(K_TREE + b * skt_b + kv * skt_h + key[:, None] * skt_n + d[None, :], kd_ok)
        v = tl.load(V_TREE + b * svt_b + kv * svt_h + key[:, None] * svt_n + d[None, :], kd_ok)
        if DOT_FP32:
            k = k.to(tl.float32)
        word = tl.load(ANC + b * sa_b + query * sa_n + start // WORD, mask=row_ok, other=0)
        visible = ((word[:, None] >> bit[None, :]) & 1) != 0
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2e
        s = tl.where(visible, s, float("-inf"))
        m, l, acc = _softmax_step(m, l, acc, s, v, DOT_FP32, PRECISION)

    # l = 0 only in padding rows (no node, or a head past G), which are not stored, and in a
    # slice past a row's root, whose partial (out 0, lse -inf) then weighs nothing in the merge.
    l = tl.where(l > 0, l, 1.0)
    out = acc / l[:, None]
    lse2 = m + tl.log2(l)  # base 2
    out_ok = row_ok[:, None] & d_ok[None, :]
    if SPLITS == 1:
        o_ptrs = OUT + b * so_b + head[:, None] * so_h + query[:, None] * so_n + d[None, :]
        tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=out_ok)
        lse_row = (b * n_kv_heads * GROUP + head) * n_queries + query
        tl.store(LSE + lse_row, lse2 * LN2, mask=row_ok)
    else:  # partials [SPLITS, B * Hq * M(, D)], rows in the order of the contiguous output
        part_row = ((split * tl.num_programs(1) + tl.program_id(1)) * GROUP + g) * n_queries + query
        tl.store(PART_OUT + part_row[:, None] * head_dim + d[None, :], out, mask=out_ok)
        tl.store(PART_LSE + part_row, lse2, mask=row_ok)


@triton.jit
def _merge_slices_kernel(
    PART_OUT, PART_LSE, OUT, LSE, n_rows, head_dim,
    SPLITS: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """out = sum_j w_j out_j / sum_j w_j with w_j = 2^(lse_j - max lse) over the root slices."""
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_ok = rows < n_rows
    d = tl.arange(0, BLOCK_D)
    out_ok = row_ok[:, None] & (d < head_dim)[None, :]
    m = tl.full([BLOCK_ROWS], float("-inf"), tl.float32)
    for j in tl.static_range(SPLITS):
        m = tl.maximum(m, tl.load(PART_LSE + j * n_rows + rows, mask=row_ok, other=float("-inf")))
    m = tl.where(m == float("-inf"), 0.0, m)  # padding rows only: every node sees itself
    l = tl.zeros([BLOCK_ROWS], tl.float32)
    acc = tl.zeros([BLOCK_ROWS, BLOCK_D], tl.float32)
    for j in tl.static_range(SPLITS):
        w = tl.exp2(tl.load(PART_LSE + j * n_rows + rows, mask=row_ok, other=float("-inf")) - m)
        part = tl.load(PART_OUT + (j * n_rows + rows)[:, None] * head_dim + d[None, :], out_ok, 0.0)
        acc += w[:, None] * part
        l += w
    l = tl.where(l > 0, l, 1.0)
    out = (acc / l[:, None]).to(OUT.dtype.element_ty)
    tl.store(OUT + rows[:, None] * head_dim + d[None, :], out, mask=out_ok)
    tl.store(LSE + rows, (m + tl.log2(l)) * LN2, mask=row_ok)


def tree_attention_triton(
    q: torch.Tensor,  # [B, Hq, M, D] the queries of the last M tree nodes
    k_root: torch.Tensor,  # [B, Hkv, S, D]
    v_root: torch.Tensor,  # [B, Hkv, S, D]
    k_tree: torch.Tensor,  # [B, Hkv, N, D]
    v_tree: torch.Tensor,  # [B, Hkv, N, D]
    plan: TreePlan,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # out [B, Hq, M, D], lse [B, Hq, M] fp32
    """The Triton backend of ``tree_attention`` (inputs already validated)."""
    return launch_tree_attention(
        q, k_root, v_root, plan.root_lens, k_tree, v_tree, plan.bits, scale
    )


def launch_tree_attention(
    q: torch.Tensor,  # [B, Hq, M, D] the queries of the last M tree nodes
    k_root: torch.Tensor,  # [B, Hkv, S, D]
    v_root: torch.Tensor,  # [B, Hkv, S, D]
    root_lens: torch.Tensor,  # [B] int64
    k_tree: torch.Tensor,  # [B, Hkv, N, D]
    v_tree: torch.Tensor,  # [B, Hkv, N, D]
    bits: torch.Tensor,  # [B, M, W] int32: the queried nodes' rows of ancestor_bitmask
    scale: float,
    config: TritonTreeConfig = TritonTreeConfig(),
) -> tuple[torch.Tensor, torch.Tensor]:  # out [B, Hq, M, D], lse [B, Hq, M] fp32
    """Launch the kernel on a prebuilt ancestor bitmask (what the benchmark times). Any strides
    work as long as the head dim is contiguous, so a slice of a larger KV cache is read in place."""
    batch, hq, m, d = q.shape
    hkv, n = k_root.shape[1], k_tree.shape[2]
    group = hq // hkv
    q, k_root, v_root, k_tree, v_tree = (
        t if t.stride(-1) == 1 else t.contiguous() for t in (q, k_root, v_root, k_tree, v_tree)
    )
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty(batch, hq, m, dtype=torch.float32, device=q.device)

    group_p2 = triton.next_power_of_2(group)
    block_nodes = min(triton.next_power_of_2(m), max(1, config.block_rows // group_p2))
    block_nodes = max(block_nodes, MIN_DOT_ROWS // group_p2)
    programs = triton.cdiv(m, block_nodes) * batch * hkv
    splits, slice_len = root_slices(programs, k_root.shape[2], q.device, config)
    block_d = max(16, triton.next_power_of_2(d))
    part_out = part_lse = out  # unused by the one-slice kernel
    if splits > 1:
        part_out = torch.empty(splits, batch * hq * m, d, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(splits, batch * hq * m, dtype=torch.float32, device=q.device)
    grid = (triton.cdiv(m, block_nodes), batch * hkv, splits)
    _tree_attention_kernel[grid](
        q, k_root, v_root, k_tree, v_tree, root_lens, bits, out, lse,
        q.stride(0), q.stride(1), q.stride(2),
        k_root.stride(0), k_root.stride(1), k_root.stride(2),
        v_root.stride(0), v_root.stride(1), v_root.stride(2),
        k_tree.stride(0), k_tree.stride(1), k_tree.stride(2),
        v_tree.stride(0), v_tree.stride(1), v_tree.stride(2),
        bits.stride(0), bits.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        part_out, part_lse,
        n, m, hkv, d, scale * LOG2E, slice_len,
        GROUP=group, GROUP_P2=group_p2, BLOCK_NODES=block_nodes,
        BLOCK_S=config.block_root, BLOCK_D=block_d, WORD=BITS_PER_WORD, SPLITS=splits,
        DOT_FP32=INTERPRETED, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    if splits > 1:
        rows = batch * hq * m
        _merge_slices_kernel[(triton.cdiv(rows, MERGE_ROWS),)](
            part_out, part_lse, out, lse, rows, d,
            SPLITS=splits, BLOCK_ROWS=MERGE_ROWS, BLOCK_D=block_d,
        )  # fmt: skip
    return out, lse


def root_slices(
    programs: int, root_size: int, device: torch.device, config: TritonTreeConfig
) -> tuple[int, int]:  # slices, keys per slice (a multiple of block_root)
    """How many slices to cut the padded root of `root_size` keys into (module docstring)."""
    if config.root_splits is not None:
        wanted = config.root_splits
    elif INTERPRETED or root_size == 0:
        wanted = 1
    else:
        target = config.programs_per_sm * _sm_count(device.index or 0)
        wanted = min(triton.cdiv(target, programs), max(1, root_size // config.min_slice))
    slice_len = triton.cdiv(max(1, triton.cdiv(root_size, wanted)), config.block_root)
    slice_len *= config.block_root
    return max(1, triton.cdiv(root_size, slice_len)), slice_len


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count
