import argparse
import time

import pytest
import torch

from genrec_spec.bench import kernel as bench_kernel
from genrec_spec.bench import kernel_tune
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


SMALL_GRID = kernel_tune.TuneGrid(
    block_rows=(16, 32), block_root=(16,), warps_stages=((4, 2),), root_splits=(None, 2)
)


def _wall_us(fn):
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e6


def _tune_small(device: str, timer) -> tuple[list, list[str]]:
    lines = []
    case = bench_kernel.Case(batch=2, root=48, nodes=12, tree="medusa")
    tuned = kernel_tune.tune(
        [case], (4, 2), 16, torch.float32, torch.device(device), SMALL_GRID, timer=timer,
        out=lines.append,
    )  # fmt: skip
    return tuned, lines


def test_tune_times_every_config_and_checks_its_output():
    tuned, lines = _tune_small("cpu", _wall_us)  # the interpreter (tests/conftest.py)
    configs = kernel_tune.configs(SMALL_GRID)
    assert len(configs) == 5 and configs[0] == kernel_tune.configs(kernel_tune.TuneGrid())[0]
    rows = [line for line in lines if " err " in line]
    assert len(rows) == len(configs)
    assert all(float(row.rsplit(" ", 1)[1]) < 1e-4 for row in rows)  # each config is exact
    fastest = min(float(row.split()[12]) for row in rows)  # printed to 0.1 us
    assert tuned[0].config in configs and abs(tuned[0].us - fastest) <= 0.05
    assert lines[-1].startswith("best medusa 2x48x12:")


def test_tune_refuses_a_cpu_device():
    with pytest.raises(ValueError, match="CUDA-graph"):
        kernel_tune.tune_kernel(
            bench_kernel.KernelBench(device="cpu"), bench_kernel.BenchConfig(), 4800.0
        )


@pytest.mark.gpu
def test_tune_on_gpu_checks_every_compiled_config():
    tuned, lines = _tune_small("cuda", kernel_tune.cudagraph_us)
    rows = [line for line in lines if " err " in line]
    assert len(rows) == 5 and all(float(row.rsplit(" ", 1)[1]) < 1e-3 for row in rows)
    assert tuned[0].us > 0
