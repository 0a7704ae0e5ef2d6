import argparse

import pytest
import torch

from genrec_spec.bench import kernel as bench_kernel
from genrec_spec.cli import bench_kernel as bench_kernel_cli
from genrec_spec.kernels import tree_depths


def test_tree_shapes():
    assert bench_kernel.chain_parents(4) == [-1, 0, 1, 2]
    assert bench_kernel.branches_parents(9) == [-1, 0, 1, 2, -1, 4, 5, 6, -1]
    medusa = bench_kernel.medusa_parents(64)
    # One root token, 8 children, 4 grandchildren each, then 2 each until 64 nodes.
    assert medusa[:10] == [-1] + [0] * 8 + [1]
    depths = tree_depths(torch.tensor([medusa, bench_kernel.chain_parents(64)]))[0]
    assert torch.bincount(depths).tolist() == [1, 8, 32, 23]


@pytest.mark.parametrize("bad", ["8x2048", "8by2048by64"])
def test_bad_shape_is_rejected(bad):
    with pytest.raises(ValueError, match="BxSxN"):
        bench_kernel.parse_shape(bad, "chain")


def test_benchmark_runs_and_every_method_agrees(capsys):
    parser = argparse.ArgumentParser()
    bench_kernel_cli.add_arguments(parser)
    args = parser.parse_args(["--shapes", "2x48x12", "--repeats", "1", "--warmup", "0"])
    assert bench_kernel_cli.run(args) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    expected_methods = ["reference", "split", "cpu", "sdpa-dense"]
    if torch.cuda.is_available():
        expected_methods += ["triton", "triton-kernel", "flex"]
    assert [row[4] for row in rows] == expected_methods * 3  # three tree shapes
    assert all(row[:4] == [row[0], "2", "48", "12"] for row in rows)
    assert all(float(row[-1]) < 1e-2 for row in rows)  # max error against the reference
