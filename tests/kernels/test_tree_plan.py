"""The per-forward TreePlan: its precomputed views, the CPU path it picks, the in-place read of a
KV-cache layout, and misuse errors. (Plan path == no-plan path over randomized shapes is checked
in test_tree_attention.py's ``check_against_reference``.)"""

import itertools

import pytest
import torch

from genrec_spec.kernels import (
    TreeAttentionError,
    ancestor_bitmask,
    ancestor_mask,
    prepare_tree,
    tree_attention,
    tree_depths,
    tree_plan,
)
from genrec_spec.kernels.tree_attention_torch import _join

TOL = dict(atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("n", [1, 9, 40])
def test_plan_holds_the_trees_views(n, tree_kinds, random_parents):
    g = torch.Generator().manual_seed(n)
    parents = torch.stack([random_parents(kind, n, g) for kind in tree_kinds])
    lens = torch.tensor([0, 3, 7, 7])
    plan = prepare_tree(parents, lens, 8)
    assert torch.equal(plan.visible, ancestor_mask(parents))
    assert torch.equal(plan.depths, tree_depths(parents))
    assert torch.equal(plan.bits, ancestor_bitmask(parents))
    # ancestors: each node, then its ancestors up to its root, -1 past it: the sets `visible` holds
    for b, i in itertools.product(range(4), range(n)):
        chain, node = [], i
        while node >= 0:
            chain.append(node)
            node = int(parents[b, node])
        row = plan.ancestors[b, i].tolist()
        assert row == chain + [-1] * (len(row) - len(chain))
    assert plan.ancestors.shape[2] == int(plan.depths.max()) + 1
    rows, real = plan.ancestor_rows  # the same nodes as rows of the [B * N] flattened tree
    assert torch.equal(real, plan.ancestors >= 0)
    assert torch.equal(rows[real], (plan.ancestors + n * torch.arange(4)[:, None, None])[real])
    assert torch.equal(prepare_tree(parents, lens, 8, queries=1).ancestors, plan.ancestors[:, -1:])
    assert plan.root_size == 8 and plan.host_root_lens == (0, 3, 7, 7)
    # The dense mask over [root[:7] | tree]: row b sees its first lens[b] root keys and its
    # ancestors; the padding mask marks root positions 0..6 past each row's length.
    root = torch.arange(7) < lens[:, None]
    visible = torch.cat([root[:, None].expand(4, n, 7), plan.visible], dim=2)
    assert plan.dense_mask.shape == (4, 1, n, 7 + n)
    assert torch.equal(plan.dense_mask[:, 0] == 0, visible)
    assert torch.equal(plan.dense_mask[:, 0] == float("-inf"), ~visible)
    assert torch.equal(plan.root_padding[:, 0, :, 0], ~root)


def test_plan_picks_the_cpu_path(monkeypatch):
    parents = torch.tensor([[-1, 0, 1], [-1, -1, 0]])
    lens = torch.tensor([5, 5])
    assert prepare_tree(parents, lens, 5).root_padding is None  # equal roots: no padding read
    assert prepare_tree(parents, torch.tensor([5, 2]), 5, finite_padding=True).root_padding is None
    for dtype in (torch.float16, torch.bfloat16):  # CPU SDPA measured slower than split there
        assert prepare_tree(parents, lens, 5, dtype=dtype).dense_mask is None
    monkeypatch.setattr(tree_plan, "DENSE_MAX_MASK_ELEMENTS", 2 * 3 * (5 + 3) - 1)
    assert prepare_tree(parents, lens, 5).dense_mask is None


def cache_layout(random_inputs, lens: list[int], n: int, padding: float):
    """Inputs whose tree K/V sit in the root buffer right after the longest root, as the
    Llama's KV cache stores a pass's pending entries; root padding filled with ``padding``."""
    batch, s = len(lens), max(lens) + n + 3
    q, k, v, root_lens, _, _, parents = random_inputs(
        batch=batch, hq=6, hkv=2, n=n, s=s, d=32, kinds=["random"] * batch, root_lens=lens
    )
    hidden = (torch.arange(s) >= root_lens[:, None])[:, None, :, None]
    k, v = k.nan_to_num(padding), v.nan_to_num(padding)
    tree = slice(max(lens), max(lens) + n)
    k[:, :, tree], v[:, :, tree] = torch.randn(2, batch, 2, n, 32).unbind()
    assert bool(hidden[:, :, tree].all())  # the tree slots are root padding for every row
    return [q, k, v, root_lens, k[:, :, tree], v[:, :, tree], parents]


@pytest.mark.parametrize("lens", [[6, 6], [6, 0, 1]])
@pytest.mark.parametrize("finite", [True, False])
def test_cache_layout_matches_reference_and_reads_in_place(random_inputs, lens, finite):
    inputs = cache_layout(random_inputs, lens, n=5, padding=1e4 if finite else float("nan"))
    q, k_root, v_root, root_lens, k_tree, v_tree, parents = inputs
    plan = prepare_tree(parents, root_lens, k_root.shape[2], finite_padding=finite)
    expected = tree_attention(*inputs, backend="torch")
    assert not expected.isnan().any()
    torch.testing.assert_close(tree_attention(*inputs, plan=plan), expected, **TOL)
    keys = _join(k_root, k_tree, plan)
    in_place = keys.data_ptr() == k_root.data_ptr()
    # Read in place unless ragged roots whose padding may be NaN must be zeroed in a copy.
    assert in_place == (finite or len(set(lens)) == 1)


def test_tree_elsewhere_in_the_buffer_is_copied(random_inputs):
    # One slot past the longest root: not adjacent, so the keys are joined by a copy.
    q, k_root, v_root, root_lens, _, _, parents = cache_layout(
        random_inputs, [4, 2], n=3, padding=0.0
    )
    k_tree, v_tree = k_root[:, :, 5:8], v_root[:, :, 5:8]
    inputs = [q, k_root, v_root, root_lens, k_tree, v_tree, parents]
    plan = prepare_tree(parents, root_lens, k_root.shape[2], finite_padding=True)
    assert _join(k_root, k_tree, plan).data_ptr() != k_root.data_ptr()
    expected = tree_attention(*inputs, backend="torch")
    torch.testing.assert_close(tree_attention(*inputs, plan=plan), expected, **TOL)


@pytest.mark.parametrize(
    "parents, lens, size, message",
    [
        (torch.tensor([[-1, 1], [-1, 0]]), torch.tensor([1, 1]), 2, r"parents\[0, 1\] = 1"),
        (torch.tensor([[-1, 0], [-1, 0]]), torch.tensor([3, 1]), 2, r"must lie in \[0, 2\]"),
        (torch.tensor([[-1, 0], [-1, 0]]), torch.tensor([1.0, 1.0]), 2, "integer"),
        (torch.tensor([[-1, 0], [-1, 0]]), torch.tensor([1, 1, 1]), 2, r"expected \[B, N\]"),
        (torch.zeros(2, 0, dtype=torch.long), torch.tensor([1, 1]), 2, "no nodes"),
    ],
)
def test_bad_tree_raises(parents, lens, size, message):
    with pytest.raises(TreeAttentionError, match=message):
        prepare_tree(parents, lens, size)


def test_plan_must_fit_the_call(random_inputs):
    inputs = random_inputs(
        batch=2, hq=4, hkv=2, n=3, s=5, d=32, kinds=["chain"] * 2, root_lens=[5, 2]
    )
    q, _, _, lens, _, _, parents = inputs
    cases = [
        (prepare_tree(parents.clone(), lens, 5), "other parents / root_lens"),
        (prepare_tree(parents, lens.clone(), 5), "other parents / root_lens"),
        (prepare_tree(parents, lens, 6), "padded to S = 6"),
        (prepare_tree(parents, lens, 5, dtype=torch.float16), "built for torch.float16"),
    ]
    for plan, message in cases:
        with pytest.raises(TreeAttentionError, match=message):
            tree_attention(*inputs, plan=plan)


@pytest.mark.parametrize("queries", [None, 5])
def test_a_plan_of_known_depth_walks_up_and_checks_it(queries, random_parents):
    # "branches" rows: chains of up to 4 nodes off the root, so depth <= 3
    g = torch.Generator().manual_seed(3)
    parents = torch.stack([random_parents("branches", 12, g) for _ in range(3)])
    depth = int(tree_depths(parents)[:, -(queries or 12) :].max())  # the queried nodes'
    lens = torch.tensor([4, 0, 2])
    unknown = prepare_tree(parents, lens, 4, queries=queries)
    for max_depth in (depth, depth + 2):  # the walk takes max_depth steps: -1 columns past
        plan = prepare_tree(parents, lens, 4, max_depth=max_depth, queries=queries)
        assert plan.ancestors.shape[2] == max_depth + 1
        assert torch.equal(plan.ancestors[..., : depth + 1], unknown.ancestors)
        assert bool((plan.ancestors[..., depth + 1 :] == -1).all())
        assert torch.equal(plan.visible, unknown.visible)  # scattered from the walk
    if depth:
        with pytest.raises(TreeAttentionError, match="more than max_depth"):
            prepare_tree(parents, lens, 4, max_depth=depth - 1, queries=queries)
