"""Launch-parameter sweep of the Triton tree-attention kernel: ``genrec-spec bench kernel --tune``.

For each shape it launches the kernel (ancestor bitmask prebuilt, as ``triton-kernel`` in
``bench kernel``) under every `TritonTreeConfig` of a grid: query rows per program, root keys
per step, warps, pipeline stages and root slices. Each launch is timed on the GPU alone, by
replaying a CUDA graph of it (``triton.testing.do_bench_cudagraph``), because at these sizes the
host's launch overhead is larger than the kernel; ``sdpa-dense`` (its concatenated K/V and mask
prebuilt) is timed the same way as the baseline. Every config's output is checked against the
reference, so a config that is fast and wrong shows up as such.

Columns: the config, microseconds, speedup over sdpa-dense, the time over the bytes floor (each
row's root K/V read once, tree Q/K/V read once, output written once, at the device's peak
memory bandwidth given by ``--peak-gbs``), and the max error against the reference. The last
``best`` line after each shape gives its fastest config and the current default's time.
"""

import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from genrec_spec.bench.errors import BenchError
from genrec_spec.bench.kernel import (
    BenchConfig,
    Case,
    KernelBench,
    bytes_floor,
    dense_inputs,
    make_inputs,
    parse_shape,
    resolve,
)
from genrec_spec.kernels import ancestor_bitmask, tree_attention
from genrec_spec.machine import describe_device


@dataclass(frozen=True)
class TuneGrid:
    """The values swept (every combination)."""

    block_rows: tuple[int, ...] = (64, 128, 256)
    block_root: tuple[int, ...] = (64, 128)
    warps_stages: tuple[tuple[int, int], ...] = ((4, 2), (4, 3), (8, 2), (8, 3))
    root_splits: tuple[int | None, ...] = (None, 1, 2, 4, 8)  # None: the default's own pick


# The launches worth a second look after a full sweep: 64-128 rows, 64-key steps, 4 warps.
NARROW = TuneGrid(block_rows=(64, 128), block_root=(64,), warps_stages=((4, 2), (4, 3)))
# Deeper pipelines than the full grid's: 3 or 4 stages of 64- or 128-key steps, 4 or 8 warps
# (the narrow sweep's best launches all took the most stages swept)
PIPELINE = TuneGrid(
    block_rows=(64, 128),
    block_root=(64, 128),
    warps_stages=((4, 3), (4, 4), (8, 3), (8, 4)),
    root_splits=(None,),
)
GRIDS = {"full": TuneGrid(), "narrow": NARROW, "pipeline": PIPELINE}


def configs(grid: TuneGrid):
    """Every TritonTreeConfig of the grid, the default first."""
    from genrec_spec.kernels.tree_attention_triton import TritonTreeConfig

    default = TritonTreeConfig()
    out = [default]
    for rows, root, (warps, stages), splits in itertools.product(
        grid.block_rows, grid.block_root, grid.warps_stages, grid.root_splits
    ):
        config = replace(
            default,
            block_rows=rows,
            block_root=root,
            num_warps=warps,
            num_stages=stages,
            root_splits=splits,
        )
        if config != default:
            out.append(config)
    return out


def describe_config(config) -> str:
    """The swept fields, e.g. 'rows 256 root 128 w8 s3 slices    4' (slices auto: the default's
    own pick)."""
    splits = "auto" if config.root_splits is None else str(config.root_splits)
    return (
        f"rows {config.block_rows:>3} root {config.block_root:>3} w{config.num_warps} "
        f"s{config.num_stages} slices {splits:>4}"
    )


def cudagraph_us(fn: Callable[[], object]) -> float:
    """GPU microseconds of one call, replayed in a CUDA graph (median)."""
    import triton.testing

    return triton.testing.do_bench_cudagraph(fn, return_mode="median") * 1e3


@dataclass(frozen=True)
class Tuned:
    case: Case
    config: object  # the fastest TritonTreeConfig
    us: float  # its time
    default_us: float
    sdpa_us: float


def tune(
    cases: Iterable[Case],
    heads: tuple[int, int],
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    grid: TuneGrid = TuneGrid(),
    peak_gbs: float = BenchConfig.peak_gbs,
    timer: Callable[[Callable[[], object]], float] = cudagraph_us,
    out: Callable[[str], None] = print,
) -> list[Tuned]:
    """Time every config of `grid` on every case; print a line per config (module docstring)
    and return each case's fastest."""
    results = []
    for case in cases:  # each case's best is printed as soon as it is known
        x = make_inputs(case, heads[0], heads[1], head_dim, dtype, device)
        r = _tune_case(case, x, grid, peak_gbs, timer, out)
        out(f"best {r.case.tree} {r.case.batch}x{r.case.root}x{r.case.nodes}: "
            f"{describe_config(r.config)} {r.us:.1f} us ({r.sdpa_us / r.us:.2f}x sdpa-dense); "
            f"default {r.default_us:.1f} us ({r.sdpa_us / r.default_us:.2f}x)")  # fmt: skip
        results.append(r)
    return results


def _tune_case(case: Case, x: dict, grid: TuneGrid, peak_gbs: float, timer, out) -> Tuned:
    from genrec_spec.kernels.tree_attention_triton import launch_tree_attention

    expected = tree_attention(**x, backend="torch").float()
    k, v, mask = dense_inputs(x)
    sdpa_us = timer(
        lambda: F.scaled_dot_product_attention(x["q"], k, v, attn_mask=mask, enable_gqa=True)
    )
    floor_us = bytes_floor(x) / (peak_gbs * 1e3)
    args = [x[name] for name in ("q", "k_root", "v_root", "root_lens", "k_tree", "v_tree")]
    args += [ancestor_bitmask(x["parents"]), x["q"].shape[-1] ** -0.5]
    head = f"{case.tree:>8} {case.batch:>3} {case.root:>5} {case.nodes:>4}"
    out(f"{head}  sdpa-dense {sdpa_us:.1f} us, bytes floor {floor_us:.1f} us")
    times, launches = {}, configs(grid)
    for config in launches:
        try:
            error = (launch_tree_attention(*args, config)[0].float() - expected).abs().max()
            us = timer(lambda c=config: launch_tree_attention(*args, c))
        except Exception as failure:  # a config past the GPU's registers or shared memory
            out(f"{head}  {describe_config(config)}  failed: {type(failure).__name__}")
            continue
        times[config] = us
        out(f"{head}  {describe_config(config)} {us:>9.1f} {sdpa_us / us:>7.2f}x "
            f"{us / floor_us:>6.1f}x floor  err {error.item():.1e}")  # fmt: skip
    best = min(times, key=times.get)
    default = times.get(launches[0], float("nan"))
    return Tuned(case, best, times[best], default, sdpa_us)


def tune_kernel(
    run: KernelBench, config: BenchConfig, peak_gbs: float, grid: TuneGrid = TuneGrid()
) -> list[Tuned]:
    """`tune` on the run's shapes (default ``config.tune_shapes``) with ``config.tune_tree``."""
    device, heads, dtype = resolve(run, config)
    if device.type != "cuda":
        raise BenchError(
            f"--tune on {device}: it times the compiled kernel by CUDA-graph replay",
            "run it on a machine with a CUDA GPU",
        )
    cases = [parse_shape(shape, config.tune_tree) for shape in run.shapes or config.tune_shapes]
    print(f"Triton tree-attention launch sweep on {describe_device(device)}: "
          f"Hq/Hkv {heads[0]}/{heads[1]}, D {config.head_dim}, {dtype}, GPU time by CUDA-graph "
          "replay (median)")  # fmt: skip
    return tune(cases, heads, config.head_dim, dtype, device, grid, peak_gbs)
