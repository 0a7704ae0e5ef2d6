"""Tree attention in plain PyTorch: the dense-mask reference and the two CPU paths.

All take already-validated inputs and their ``TreePlan`` (see ``tree_attention.tree_attention``;
q holds the queries of the last M of the N tree nodes, M = N unless the tree was grown)
and return the output in q's dtype; the reference and the split path also the fp32 log-sum-exp
of each query row's scaled scores. Every node sees itself, so no row is ever fully masked and no
path can produce NaN.
"""

import torch
import torch.nn.functional as F

from genrec_spec.kernels.tree_plan import TreePlan


def tree_attention_reference(
    q: torch.Tensor,  # [B, Hq, M, D]
    k_root: torch.Tensor,  # [B, Hkv, S, D]
    v_root: torch.Tensor,  # [B, Hkv, S, D]
    k_tree: torch.Tensor,  # [B, Hkv, N, D]
    v_tree: torch.Tensor,  # [B, Hkv, N, D]
    plan: TreePlan,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # out [B, Hq, M, D], lse [B, Hq, M] fp32
    """The specification: one dense [M, S + N] visibility mask per row over [root | tree] keys,
    GQA by repeating K/V to every query head, softmax in fp32."""
    batch, hq, m, _ = q.shape
    hkv, s = k_root.shape[1], k_root.shape[2]
    root_visible = torch.arange(s, device=q.device) < plan.root_lens[:, None]  # [B, S]
    # Padding may hold anything (an uninitialised cache, NaN); 0 * NaN would leak into the output.
    v_root = v_root.masked_fill(~root_visible[:, None, :, None], 0)
    k = torch.cat([k_root, k_tree], dim=2).repeat_interleave(hq // hkv, dim=1).float()
    v = torch.cat([v_root, v_tree], dim=2).repeat_interleave(hq // hkv, dim=1).float()
    visible = torch.cat(
        [root_visible[:, None, :].expand(batch, m, s), plan.visible], dim=2
    )  # [B, M, S + N]
    scores = (q.float() @ k.transpose(-1, -2)) * scale  # [B, Hq, M, S + N]
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    lse = scores.logsumexp(dim=-1)  # [B, Hq, M]
    out = torch.exp(scores - lse[..., None]) @ v
    return out.to(q.dtype), lse


def tree_attention_split(
    q: torch.Tensor,  # [B, Hq, M, D]
    k_root: torch.Tensor,  # [B, Hkv, S, D]
    v_root: torch.Tensor,  # [B, Hkv, S, D]
    k_tree: torch.Tensor,  # [B, Hkv, N, D]
    v_tree: torch.Tensor,  # [B, Hkv, N, D]
    plan: TreePlan,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # out [B, Hq, M, D], lse [B, Hq, M] fp32
    """Split attention. The root part multiplies each (row, KV head)'s root keys once by the
    queries of all M nodes and all G query heads of that KV head (q viewed as [B*Hkv, G*M, D]:
    no repeated K/V, no [M, S] mask); the tree part uses the [M, N] ancestor mask, or on a wide
    shallow tree (``plan.gather``) gathers each query's few ancestors' keys and values; the two
    softmax partials merge exactly by their log-sum-exp."""
    batch, hq, n, d = q.shape  # n: the M queries
    hkv = k_root.shape[1]
    group = hq // hkv
    # Head h = kv * G + g, so this view stacks the G query heads of each KV head.
    qg = (q.float() * scale).reshape(batch * hkv, group * n, d)
    # On a GPU (where this path is only a fallback) the plan has no host lengths: one sync.
    host_lens = plan.root_lens.tolist() if plan.host_root_lens is None else plan.host_root_lens
    lens = [length for length in host_lens for _ in range(hkv)]
    root = _root_partial(
        qg, k_root.flatten(0, 1), v_root.flatten(0, 1), plan.root_lens.repeat_interleave(hkv), lens
    )
    if plan.gather:
        tree = _tree_gather_partial(qg, k_tree, v_tree, *plan.ancestor_rows)
    else:
        visible = plan.visible.repeat_interleave(hkv, dim=0)  # [B*Hkv, M, N]
        tree = _tree_partial(qg, k_tree.flatten(0, 1), v_tree.flatten(0, 1), visible)
    out, lse = _merge(root, tree)
    return out.view(batch, hq, n, d).to(q.dtype), lse.view(batch, hq, n)


def tree_attention_dense(
    q: torch.Tensor,  # [B, Hq, M, D]
    k_root: torch.Tensor,  # [B, Hkv, S, D]
    v_root: torch.Tensor,  # [B, Hkv, S, D]
    k_tree: torch.Tensor,  # [B, Hkv, N, D]
    v_tree: torch.Tensor,  # [B, Hkv, N, D]
    plan: TreePlan,
    scale: float,
) -> torch.Tensor:  # out [B, Hq, M, D]
    """The dense CPU path: one SDPA call (GQA without repeated K/V) over the keys
    [root[:max_len] | tree] with the plan's prebuilt additive mask, a few ops in all. Needs
    ``plan.dense_mask`` (the plan decides, see ``tree_plan.DENSE_MAX_MASK_ELEMENTS``); returns
    no log-sum-exp (SDPA does not give it)."""
    keys = _join(k_root, k_tree, plan)
    values = _join(v_root, v_tree, plan)
    grouped = q.shape[1] != k_root.shape[1]
    return F.scaled_dot_product_attention(
        q, keys, values, attn_mask=plan.dense_mask, scale=scale, enable_gqa=grouped
    )


def _join(
    root: torch.Tensor,  # [B, Hkv, S, D]
    tree: torch.Tensor,  # [B, Hkv, N, D]
    plan: TreePlan,
) -> torch.Tensor:  # [B, Hkv, max_len + N, D]: root[:, :, :max_len] then tree
    """The dense path's keys (or values). When ``tree`` already sits in ``root``'s buffer right
    after the longest root (how the Llama's KV cache stores a pass's pending entries), that is a
    view, no copy. Otherwise a copy, in which padding is zeroed unless the plan knows it finite
    (0 * NaN would leak through the zero attention weights)."""
    low, high = plan.min_root_len, plan.max_root_len
    n = tree.shape[2]
    if plan.root_padding is None and _follows(root, tree, high):
        return root[:, :, : high + n]
    joined = torch.cat([root[:, :, :high], tree], dim=2)
    if plan.root_padding is not None:
        joined[:, :, low:high].masked_fill_(plan.root_padding, 0)
    return joined


def _follows(root: torch.Tensor, tree: torch.Tensor, offset: int) -> bool:
    """Whether ``tree`` is exactly ``root``'s positions [offset, offset + N) (same buffer and
    strides), so ``root[:, :, :offset + N]`` holds the root prefix followed by the tree."""
    return (
        tree.untyped_storage().data_ptr() == root.untyped_storage().data_ptr()
        and tree.stride() == root.stride()
        and tree.storage_offset() == root.storage_offset() + offset * root.stride(2)
        and offset + tree.shape[2] <= root.shape[2]
    )


# A softmax partial over some keys: running max [R, M], sum of exp(score - max) [R, M], and the
# unnormalised output [R, M, D] (sum of exp(score - max) * value), for R rows of M queries.
Partial = tuple[torch.Tensor, torch.Tensor, torch.Tensor]

# Root scores per step, in elements (1 MiB of fp32): small enough to stay in the CPU's L2 cache
# between the matmul and the softmax passes over them, which makes the root part faster than
# one batch-wide pass.
ROOT_CHUNK_SCORES = 1 << 18


def _root_partial(
    qg: torch.Tensor,  # [R, M, D] fp32, scaled; R = B*Hkv rows of M = G*N queries
    k: torch.Tensor,  # [R, S, D]
    v: torch.Tensor,  # [R, S, D]
    lens: torch.Tensor,  # [R] int64
    lengths: list[int],  # lens on the host
) -> Partial:
    """The root part, a few (row, KV head) pairs at a time, each step cut to its longest root
    (so padding is read only up to that length)."""
    rows, m, d = qg.shape
    row_max = qg.new_full((rows, m), float("-inf"))
    total, out = qg.new_zeros(rows, m), qg.new_zeros(rows, m, d)
    step = max(1, ROOT_CHUNK_SCORES // (m * max(max(lengths), 1)))
    for start in range(0, rows, step):
        rs = slice(start, start + step)
        length = max(lengths[rs])
        if length == 0:
            continue
        k_c, v_c = k[rs, :length].float(), v[rs, :length].float()
        scores = qg[rs] @ k_c.transpose(1, 2)  # [step, M, length]
        if min(lengths[rs]) < length:
            hidden = torch.arange(length, device=qg.device) >= lens[rs, None]  # [step, length]
            scores.masked_fill_(hidden[:, None, :], float("-inf"))
            # Padding may hold anything (an uninitialised cache, NaN); 0 * NaN would leak.
            v_c = v_c.masked_fill(hidden[:, :, None], 0)
        row_max[rs] = scores.amax(dim=-1)
        # An empty row's max is -inf; shift it by a finite number so exp gives 0, not NaN.
        shift = row_max[rs].clamp_min(torch.finfo(torch.float32).min)
        scores.sub_(shift[..., None]).exp_()
        total[rs] = scores.sum(dim=-1)
        torch.matmul(scores, v_c, out=out[rs])
    return row_max, total, out


def _tree_partial(
    qg: torch.Tensor,  # [R, G*Q, D] fp32, scaled; Q queried nodes, G query heads per KV head
    k: torch.Tensor,  # [R, N, D]
    v: torch.Tensor,  # [R, N, D]
    visible: torch.Tensor,  # [R, Q, N] bool ancestor mask of the queried nodes
) -> Partial:
    """The tree part: every node sees itself, so each query has a finite max."""
    rows, m, _ = qg.shape
    queried, n = visible.shape[1], k.shape[1]
    scores = (qg @ k.float().transpose(1, 2)).view(rows, m // queried, queried, n)
    scores = scores.masked_fill_(~visible[:, None], float("-inf")).view(rows, m, n)
    row_max = scores.amax(dim=-1)
    scores.sub_(row_max[..., None]).exp_()
    return row_max, scores.sum(dim=-1), scores @ v.float()


def _tree_gather_partial(
    qg: torch.Tensor,  # [R, G*M, D] fp32, scaled; R = B*Hkv rows, G query heads per KV head
    k: torch.Tensor,  # [B, Hkv, N, D]
    v: torch.Tensor,  # [B, Hkv, N, D]
    rows: torch.Tensor,  # [B, M, A] int64 each query's own node and ancestors, rows of [B * N]
    real: torch.Tensor,  # [B, M, A] bool which of them exist (``TreePlan.ancestor_rows``)
) -> Partial:
    """The tree part over the A <= max_depth + 1 nodes each query sees, gathered: A keys a
    query instead of N behind a mask. Every node sees itself, so each query has a finite max."""
    batch, hkv, n, d = k.shape
    m = rows.shape[1]
    group = qg.shape[1] // m
    # [B, Hkv, M, D, A] and [B, Hkv, M, A, D]: each query's keys and values, per KV head
    keys = k.transpose(1, 2).reshape(batch * n, hkv, d)[rows].permute(0, 3, 1, 4, 2).float()
    values = v.transpose(1, 2).reshape(batch * n, hkv, d)[rows].permute(0, 3, 1, 2, 4).float()
    queries = qg.view(batch, hkv, group, m, d).transpose(2, 3)  # [B, Hkv, M, G, D]
    scores = queries @ keys  # [B, Hkv, M, G, A]
    scores = scores.masked_fill_(~real[:, None, :, None, :], float("-inf"))
    row_max = scores.amax(dim=-1)  # [B, Hkv, M, G]
    scores = scores.sub_(row_max[..., None]).exp_()
    out = scores @ values  # [B, Hkv, M, G, D]

    def as_rows(t: torch.Tensor) -> torch.Tensor:  # [B, Hkv, M, G, ...] -> [R, G*M, ...]
        return t.transpose(2, 3).reshape(batch * hkv, group * m, *t.shape[4:])

    return as_rows(row_max), as_rows(scores.sum(dim=-1)), as_rows(out)


def _merge(a: Partial, b: Partial) -> tuple[torch.Tensor, torch.Tensor]:  # [R, M, D], [R, M]
    """Normalised output and log-sum-exp of the union of two partials' keys (b's max finite)."""
    row_max = torch.maximum(a[0], b[0])
    scale_a, scale_b = torch.exp(a[0] - row_max), torch.exp(b[0] - row_max)
    total = a[1] * scale_a + b[1] * scale_b
    out = (a[2] * scale_a[..., None] + b[2] * scale_b[..., None]) / total[..., None]
    return out, row_max + total.log()
