import os
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from genrec_spec.kernels import (
    TreeAttentionError,
    prepare_tree,
    tree_attention,
    tree_depths,
    tree_plan,
)

# Compiled Triton kernels take CUDA tensors; without a GPU the interpreter takes CPU ones. So the
# Triton cases below run compiled wherever a GPU is present, interpreted elsewhere.
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def on_backend_device(inputs, backend):
    device = TRITON_DEVICE if backend == "triton" else "cpu"
    return [t.to(device) for t in inputs]


TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def oracle(q, k_root, v_root, root_lens, k_tree, v_tree, parents):
    """Each node, one at a time: ordinary attention of its query, placed last in the sequence
    root + its root-to-node path, over that whole sequence (what a causal model computes for
    the last token). Float64; returns out [B, Hq, N, D] and lse [B, Hq, N]."""
    batch, hq, n, d = q.shape
    group = hq // k_root.shape[1]
    out = torch.zeros(batch, hq, n, d, dtype=torch.float64)
    lse = torch.zeros(batch, hq, n, dtype=torch.float64)
    for b in range(batch):
        for i in range(n):
            path = [i]
            while parents[b, path[-1]] >= 0:
                path.append(int(parents[b, path[-1]]))
            path.reverse()
            for h in range(hq):
                kv = h // group
                keys = torch.cat([k_root[b, kv, : root_lens[b]], k_tree[b, kv, path]]).double()
                values = torch.cat([v_root[b, kv, : root_lens[b]], v_tree[b, kv, path]]).double()
                scores = keys @ q[b, h, i].double() / d**0.5
                out[b, h, i] = scores.softmax(0) @ values
                lse[b, h, i] = scores.logsumexp(0)
    return out, lse


def assert_matches(got, expected, dtype):
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.cpu().double(), expected.cpu().double(), atol=tol, rtol=tol)


@st.composite
def shapes(draw, kinds, head_dims, max_n, max_s):
    """Keyword arguments of ``make_inputs``: B 1-3, GQA ratio 1-4, ragged roots with 0 and 1."""
    batch = draw(st.integers(1, 3))
    s = draw(st.integers(1, max_s))
    length = st.one_of(st.just(0), st.just(1), st.integers(0, s)).map(lambda x: min(x, s))
    hkv = draw(st.integers(1, 2))
    return dict(
        batch=batch,
        hkv=hkv,
        hq=hkv * draw(st.sampled_from([1, 2, 3, 4])),
        n=draw(st.integers(1, max_n)),
        s=s,
        d=draw(st.sampled_from(head_dims)),
        kinds=draw(st.lists(st.sampled_from(kinds), min_size=batch, max_size=batch)),
        root_lens=draw(st.lists(length, min_size=batch, max_size=batch)),
        seed=draw(st.integers(0, 2**16)),
    )


# A fixed B=3 case beside the drawn ones: ragged roots 0 / 1 / full under three tree shapes.
B3 = dict(batch=3, hkv=1, hq=3, n=9, s=5, d=32, kinds=["chain", "star", "random"])
B3_LENS = [0, 1, 5]
# Session fixtures inside @given are fine: they hold plain functions, never reset per example.
PROPERTY = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@settings(max_examples=12, **PROPERTY)
@given(data=st.data())
def test_reference_matches_per_node_oracle(random_inputs, tree_kinds, data):
    case = data.draw(shapes(tree_kinds, head_dims=[32], max_n=12, max_s=10))
    for inputs in (random_inputs(**case), random_inputs(**B3, root_lens=B3_LENS)):
        out, lse = tree_attention(*inputs, backend="torch", return_lse=True)
        expected_out, expected_lse = oracle(*inputs)
        assert_matches(out, expected_out, torch.float32)
        assert_matches(lse, expected_lse, torch.float32)


def check_against_reference(inputs, backend, dtype):
    """With and without a prebuilt plan (which must give exactly the same result); on the CPU
    backend also without the log-sum-exp, which takes the dense path for float32."""
    expected_out, expected_lse = tree_attention(*inputs, backend="torch", return_lse=True)
    inputs = on_backend_device(inputs, backend)
    q, k_root, _, root_lens, _, _, parents = inputs
    plan = prepare_tree(parents, root_lens, k_root.shape[2], dtype=q.dtype)
    out, lse = tree_attention(*inputs, backend=backend, return_lse=True)
    planned_out, planned_lse = tree_attention(*inputs, backend=backend, return_lse=True, plan=plan)
    assert out.dtype == dtype and lse.dtype == torch.float32 and not out.isnan().any()
    assert_matches(out, expected_out, dtype)
    assert_matches(lse, expected_lse, torch.float32)
    assert torch.equal(planned_out, out) and torch.equal(planned_lse, lse)
    if backend != "cpu":
        return
    out = tree_attention(*inputs, backend=backend)
    assert out.dtype == dtype and not out.isnan().any()
    assert_matches(out, expected_out, dtype)
    assert torch.equal(tree_attention(*inputs, backend=backend, plan=plan), out)


@settings(max_examples=40, **PROPERTY)
@given(dtype=st.sampled_from([torch.float32, torch.float16]), data=st.data())
def test_cpu_path_matches_reference(random_inputs, tree_kinds, dtype, data):
    case = data.draw(shapes(tree_kinds, head_dims=[32, 64, 128], max_n=70, max_s=100))
    check_against_reference(random_inputs(**case, dtype=dtype), "cpu", dtype)
    check_against_reference(random_inputs(**B3, root_lens=B3_LENS, dtype=dtype), "cpu", dtype)


@settings(max_examples=25, **PROPERTY)
@given(dtype=st.sampled_from([torch.float32, torch.float16]), data=st.data())
def test_triton_matches_reference(random_inputs, tree_kinds, dtype, data):
    case = data.draw(shapes(tree_kinds, head_dims=[32, 64], max_n=40, max_s=70))
    check_against_reference(random_inputs(**case, dtype=dtype), "triton", dtype)


def test_triton_matches_reference_on_ragged_b3(random_inputs):
    for dtype in (torch.float32, torch.float16):
        inputs = random_inputs(**B3, root_lens=B3_LENS, dtype=dtype)
        check_against_reference(inputs, "triton", dtype)


def test_triton_handles_512_nodes(random_inputs):
    # Several node blocks and 16 bitmask words per node; a deep chain and a random tree.
    case = dict(batch=2, hkv=1, hq=2, n=512, s=40, d=32, kinds=["chain", "random"])
    inputs = random_inputs(**case, root_lens=[40, 3])
    expected = tree_attention(*inputs, backend="torch")
    assert_matches(
        tree_attention(*on_backend_device(inputs, "triton"), backend="triton"),
        expected,
        torch.float32,
    )


@pytest.mark.parametrize("splits", [2, 3, 5])
def test_triton_root_slices_merge_exactly(random_inputs, splits):
    # Roots cut into slices of 16 keys or more, merged by log-sum-exp: rows whose root ends
    # before the last slice (0, 1 and 20 keys of 70) leave later slices empty.
    from genrec_spec.kernels.tree_attention_triton import TritonTreeConfig, launch_tree_attention

    case = dict(batch=4, hkv=2, hq=4, n=9, s=70, d=32, kinds=["chain", "random", "star", "random"])
    inputs = random_inputs(**case, root_lens=[0, 1, 20, 70])
    expected_out, expected_lse = tree_attention(*inputs, backend="torch", return_lse=True)
    q, k_root, v_root, lens, k_tree, v_tree, parents = on_backend_device(inputs, "triton")
    bits = prepare_tree(parents, lens, k_root.shape[2]).bits
    config = TritonTreeConfig(block_root=16, root_splits=splits)
    out, lse = launch_tree_attention(
        q, k_root, v_root, lens, k_tree, v_tree, bits, 32**-0.5, config
    )
    assert_matches(out, expected_out, torch.float32)
    assert_matches(lse, expected_lse, torch.float32)


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
def test_empty_root_star_sees_only_itself(backend, random_inputs):
    # root_lens 0 and no tree ancestors: each node's only key is itself, so out = its value.
    case = dict(batch=2, hkv=2, hq=6, n=5, s=4, d=32, kinds=["star", "star"], root_lens=[0, 0])
    q, k_root, v_root, lens, k_tree, v_tree, parents = random_inputs(**case)
    inputs = on_backend_device([q, k_root, v_root, lens, k_tree, v_tree, parents], backend)
    out, lse = tree_attention(*inputs, backend=backend, return_lse=True)
    expected = v_tree.repeat_interleave(3, dim=1)  # query head h reads KV head h // 3
    assert_matches(out, expected, torch.float32)
    scores = (q * k_tree.repeat_interleave(3, dim=1)).sum(-1) / 32**0.5
    assert_matches(lse, scores, torch.float32)


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
def test_single_node_with_empty_root_is_not_nan(backend, random_inputs):
    inputs = random_inputs(
        batch=2, hq=2, hkv=1, n=1, s=3, d=32, kinds=["chain"] * 2, root_lens=[0, 0]
    )
    out = tree_attention(*on_backend_device(inputs, backend), backend=backend)
    expected = inputs[5].repeat_interleave(2, dim=1)  # v_tree: the node's only key is itself
    assert_matches(out, expected, torch.float32)


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
@pytest.mark.parametrize("queries", [1, 4, 9])
def test_querying_the_last_nodes_of_a_grown_tree(backend, queries, random_inputs):
    # A tree grown pass by pass queries only its newest M nodes: their rows of the full result.
    for dtype in (torch.float32, torch.float16):
        inputs = random_inputs(**B3, root_lens=B3_LENS, dtype=dtype)
        expected_out, expected_lse = tree_attention(*inputs, backend="torch", return_lse=True)
        q, k_root, v_root, lens, k_tree, v_tree, parents = on_backend_device(inputs, backend)
        suffix = [q[:, :, -queries:], k_root, v_root, lens, k_tree, v_tree, parents]
        out, lse = tree_attention(*suffix, backend=backend, return_lse=True)
        assert_matches(out, expected_out[:, :, -queries:], dtype)
        assert_matches(lse, expected_lse[:, :, -queries:], torch.float32)
        if backend == "cpu":  # the dense path too
            plan = prepare_tree(parents, lens, k_root.shape[2], dtype=dtype, queries=queries)
            dense = tree_attention(*suffix, backend=backend, plan=plan)
            assert_matches(dense, expected_out[:, :, -queries:], dtype)


def check_gathered(inputs, queries: int, dtype) -> None:
    """The split path with each query's ancestors gathered (a plan that knows the depth and the
    tree wide enough: ``tree_plan.GATHER_MIN_NODES``) against the reference, on the last
    ``queries`` nodes; the dense path never serves such a plan."""
    expected_out, expected_lse = tree_attention(*inputs, backend="torch", return_lse=True)
    q, k_root, v_root, lens, k_tree, v_tree, parents = inputs
    depth = int(tree_depths(parents).max())
    plan = prepare_tree(
        parents, lens, k_root.shape[2], dtype=dtype, max_depth=depth, queries=queries
    )
    assert plan.gather and plan.dense_mask is None
    suffix = [q[:, :, -queries:], k_root, v_root, lens, k_tree, v_tree, parents]
    for lse_too in (True, False):
        got = tree_attention(*suffix, backend="cpu", plan=plan, return_lse=lse_too)
        out, lse = got if lse_too else (got, None)
        assert out.dtype == dtype and not out.isnan().any()
        assert_matches(out, expected_out[:, :, -queries:], dtype)
        if lse_too:
            assert_matches(lse, expected_lse[:, :, -queries:], torch.float32)


@settings(max_examples=30, **PROPERTY)
@given(dtype=st.sampled_from([torch.float32, torch.float16]), data=st.data())
def test_gathered_tree_part_matches_reference(random_inputs, tree_kinds, dtype, data, monkeypatch):
    # Small trees of every kind, the gather forced by a threshold of one node; GQA, ragged roots
    # with NaN padding, the last M of N nodes queried
    monkeypatch.setattr(tree_plan, "GATHER_MIN_NODES", 1)
    case = data.draw(shapes(tree_kinds, head_dims=[32, 64], max_n=40, max_s=50))
    queries = data.draw(st.integers(1, case["n"]))
    check_gathered(random_inputs(**case, dtype=dtype), queries, dtype)


def test_wide_shallow_trees_gather_at_the_threshold(random_inputs):
    # Prefix-tree-like rows (chains of up to 4 off the root) at the real threshold
    n = tree_plan.GATHER_MIN_NODES
    case = dict(batch=2, hkv=1, hq=2, n=n, s=30, d=32, kinds=["branches"] * 2, root_lens=[30, 7])
    check_gathered(random_inputs(**case), n, torch.float32)
    q, k_root, _, lens, _, _, parents = random_inputs(**{**case, "n": n - 1})
    plan = prepare_tree(parents, lens, k_root.shape[2], max_depth=int(tree_depths(parents).max()))
    assert not plan.gather and plan.dense_mask is not None  # a node fewer: the dense path


def test_a_plan_for_other_queries_is_refused(random_inputs):
    q, k_root, v_root, lens, k_tree, v_tree, parents = random_inputs(**B3, root_lens=B3_LENS)
    plan = prepare_tree(parents, lens, k_root.shape[2], queries=2)
    with pytest.raises(TreeAttentionError, match="built for 2 queries"):
        tree_attention(q[:, :, -3:], k_root, v_root, lens, k_tree, v_tree, parents, plan=plan)
    with pytest.raises(TreeAttentionError, match="queries = 10"):
        prepare_tree(parents, lens, k_root.shape[2], queries=10)


def test_auto_picks_the_cpu_path_for_cpu_tensors(random_inputs):
    inputs = random_inputs(
        batch=2, hq=4, hkv=2, n=6, s=8, d=32, kinds=["random"] * 2, root_lens=[8, 2]
    )
    assert torch.equal(tree_attention(*inputs), tree_attention(*inputs, backend="cpu"))


def test_explicit_scale(random_inputs):
    inputs = random_inputs(
        batch=2, hq=2, hkv=1, n=4, s=6, d=32, kinds=["chain"] * 2, root_lens=[6, 1]
    )
    q = inputs[0]
    doubled = tree_attention(q * 2, *inputs[1:], backend="torch")
    assert_matches(
        tree_attention(*inputs, scale=2 / 32**0.5, backend="cpu"), doubled, torch.float32
    )


@pytest.fixture
def good_inputs(random_inputs):
    return dict(
        zip(
            ["q", "k_root", "v_root", "root_lens", "k_tree", "v_tree", "parents"],
            random_inputs(
                batch=2, hq=4, hkv=2, n=3, s=5, d=32, kinds=["chain"] * 2, root_lens=[5, 2]
            ),
            strict=True,
        )
    )


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(k_tree=torch.zeros(2, 2, 4, 32)), r"k_tree has shape \(2, 2, 4, 32\)"),
        (dict(v_root=torch.zeros(2, 2, 5, 16)), "v_root has shape"),
        (dict(q=torch.zeros(2, 3, 3, 32)), "3 query heads cannot share 2 KV heads"),
        (dict(parents=torch.tensor([[-1, 0, 2], [-1, 0, 1]])), r"parents\[0, 2\] = 2"),
        (dict(parents=torch.tensor([[-1, 0, 1]])), r"parents has shape \(1, 3\)"),
        (dict(root_lens=torch.tensor([6, 2])), r"must lie in \[0, 5\]"),
        (dict(root_lens=torch.tensor([5.0, 2.0])), "integer"),
        (dict(v_tree=torch.zeros(2, 2, 3, 32, dtype=torch.float64)), "v_tree is torch.float64"),
        (dict(q=torch.zeros(2, 4, 3)), "q must be 4-D"),
    ],
)
def test_bad_input_raises(good_inputs, change, message):
    with pytest.raises(TreeAttentionError, match=message):
        tree_attention(**{**good_inputs, **change}, backend="cpu")


def test_unknown_backend_raises(good_inputs):
    with pytest.raises(TreeAttentionError, match="unknown backend 'cuda'"):
        tree_attention(**good_inputs, backend="cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_triton_on_cpu_without_interpreter_raises(good_inputs, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(TreeAttentionError, match="compiled Triton kernels run on CUDA only"):
        tree_attention(**good_inputs, backend="triton")


def test_importing_kernels_does_not_import_triton():
    code = "import sys, genrec_spec.kernels; sys.exit('triton' in sys.modules)"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    assert subprocess.run([sys.executable, "-c", code], env=env).returncode == 0


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "case",
    [
        dict(batch=4, hkv=2, hq=8, n=512, s=4096, d=128, kinds=["random", "chain"] * 2),
        dict(
            batch=32,
            hkv=2,
            hq=8,
            n=64,
            s=2048,
            d=64,
            kinds=["chain", "star", "branches", "random"] * 8,
        ),
        dict(batch=3, hkv=3, hq=9, n=17, s=300, d=64, kinds=["branches", "star", "random"]),
    ],
)
def test_compiled_triton_matches_reference_on_gpu(case, dtype, random_inputs):
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(0, case["s"] + 1, (case["batch"],), generator=g)
    lens[0] = 0
    inputs = random_inputs(**case, root_lens=lens.tolist(), dtype=dtype)
    inputs = [t.cuda() for t in inputs]
    out, lse = tree_attention(*inputs, return_lse=True)  # auto picks triton on CUDA
    expected_out, expected_lse = tree_attention(*inputs, backend="torch", return_lse=True)
    assert not out.isnan().any()
    assert_matches(out, expected_out, dtype)
    assert_matches(lse, expected_lse, dtype)


@pytest.mark.gpu
def test_compiled_triton_reads_a_cache_slice_in_place(random_inputs):
    # A static cache [B, Hkv, S_max, D] sliced to S: strided, not contiguous.
    case = dict(batch=2, hkv=2, hq=4, n=20, s=256, d=64, kinds=["random", "branches"])
    q, k_cache, v_cache, lens, k_tree, v_tree, parents = random_inputs(**case, root_lens=[100, 7])
    # Sliced on the GPU: moving a slice copies it into a contiguous tensor.
    inputs = [q.cuda(), k_cache.cuda()[:, :, :128], v_cache.cuda()[:, :, :128]]
    inputs += [t.cuda() for t in (lens, k_tree, v_tree, parents)]
    assert not inputs[1].is_contiguous()
    expected = tree_attention(*inputs, backend="torch")
    assert_matches(tree_attention(*inputs, backend="triton"), expected, torch.float32)
