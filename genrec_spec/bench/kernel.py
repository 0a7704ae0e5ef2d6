"""Benchmark of shared-context tree attention: ``genrec-spec bench kernel``.

For each shape (B rows, root length S, N tree nodes) and tree (a chain, candidate-item branches,
a Medusa-style tree) it times, side by side in one run:

- ``reference``: the public op with backend="torch" (dense mask, fp32 softmax);
- ``split``: backend="cpu" with the log-sum-exp returned, which forces the split path (root
  part as one matmul shared by all nodes, tree part with the small ancestor mask, merged by
  log-sum-exp);
- ``cpu``: backend="cpu" as "auto" picks it without a GPU (for fp32 and moderate masks one SDPA
  call over [root | tree] with the tree plan's additive mask, else the split path);
- ``sdpa-dense``: ``F.scaled_dot_product_attention`` with a dense boolean mask;
- on CUDA also ``triton`` (the public op), ``triton-kernel`` (the kernel launch alone, ancestor
  bitmask prebuilt) and ``flex`` (compiled FlexAttention with a block mask).

The baselines get their concatenated K/V and masks prebuilt outside the timing (their best
case); ``reference``, ``split``, ``cpu`` and ``triton`` are timed as the public op is called,
input checks and mask building included. Times are medians over repeats; ``speedup`` is over
sdpa-dense on GPU and over the reference on CPU; ``GB/s`` is the bytes floor (each row's root
K/V read once, tree Q/K/V read once, output written once) divided by the time; ``max err`` is
the largest absolute difference from the reference's output.
"""

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from genrec_spec.bench.errors import BenchError
from genrec_spec.kernels import ancestor_bitmask, ancestor_mask, tree_attention
from genrec_spec.machine import describe_device

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class BenchConfig:
    """Defaults of ``genrec-spec bench kernel``."""

    # BxSxN shapes: a grid per device, sized for a short run.
    cpu_shapes: tuple[str, ...] = (
        "1x512x16",
        "1x8192x64",
        "8x2048x64",
        "2x2048x256",
        "64x512x16",
        "4x8192x16",
    )
    gpu_shapes: tuple[str, ...] = (
        "1x2048x64",
        "8x2048x64",
        "32x512x64",
        "32x2048x16",
        "32x2048x64",
        "32x2048x256",
        "32x8192x64",
        "64x2048x64",
        "64x8192x256",
    )
    quick_shapes: tuple[str, ...] = ("2x512x16", "4x1024x32")
    # --tune: the target shape first, then one row, a few rows, a long root.
    tune_shapes: tuple[str, ...] = ("32x2048x64", "1x2048x64", "8x2048x64", "32x8192x64")
    tune_tree: str = "medusa"
    peak_gbs: float = 4800.0  # an H200's HBM3e, for the bytes floor of --tune
    trees: tuple[str, ...] = ("chain", "branches", "medusa")
    cpu_heads: str = "9/3"  # SmolLM2-135M's query / KV heads, the LLM this project runs on CPU
    gpu_heads: str = "8/2"  # a GPU target's query / KV heads
    head_dim: int = 64
    cpu_dtype: str = "float32"  # CPUs have no fast half-precision attention path
    gpu_dtype: str = "bfloat16"
    repeats: int = 5  # timed calls per method; the median is reported
    warmup: int = 1  # untimed calls first (Triton and FlexAttention compile on the first)
    threads: int = 1  # torch CPU threads; 2 threads on 2 shared cores mostly add wake-up cost
    seed: int = 0


# Trees. Each returns parents [N]: topologically ordered, -1 = child of the root context.


def chain_parents(n: int) -> list[int]:
    """A single draft sequence (classic speculative decoding, n-gram drafts)."""
    return list(range(-1, n - 1))


def branches_parents(n: int, codes: int = 4) -> list[int]:
    """Candidate items as separate branches of ``codes`` semantic-ID codes each."""
    return [-1 if i % codes == 0 else i - 1 for i in range(n)]


def medusa_parents(n: int, top_fanout: int = 8) -> list[int]:
    """A Medusa-style tree: one root token, then each level's nodes fan out half as wide as the
    level above (8, 4, 2, 1, 1, ...), filled breadth first up to n nodes."""
    parents, frontier, depth = [-1], [0], 0
    while len(parents) < n:
        fanout, next_frontier = max(1, top_fanout >> depth), []
        for node in frontier:
            for _ in range(fanout):
                if len(parents) < n:
                    next_frontier.append(len(parents))
                    parents.append(node)
        frontier, depth = next_frontier, depth + 1
    return parents[:n]


TREES: dict[str, Callable[[int], list[int]]] = {
    "chain": chain_parents,
    "branches": branches_parents,
    "medusa": medusa_parents,
}


@dataclass(frozen=True)
class Case:
    batch: int
    root: int
    nodes: int
    tree: str


def parse_shape(text: str, tree: str) -> Case:
    try:
        batch, root, nodes = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise BenchError(f"shape {text!r} is not BxSxN", "write it as e.g. 8x2048x64") from None
    return Case(batch, root, nodes, tree)


def make_inputs(
    case: Case, hq: int, hkv: int, head_dim: int, dtype: torch.dtype, device: torch.device
) -> dict[str, torch.Tensor]:
    """Random q/k/v; every row has the full root (S keys) and the same tree."""
    g = torch.Generator(device=device).manual_seed(BenchConfig.seed)
    b, s, n, d = case.batch, case.root, case.nodes, head_dim

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=device, dtype=dtype)

    parents = torch.tensor(TREES[case.tree](n), device=device).repeat(b, 1)  # [B, N]
    return dict(
        q=randn(b, hq, n, d),
        k_root=randn(b, hkv, s, d),
        v_root=randn(b, hkv, s, d),
        root_lens=torch.full((b,), s, device=device),
        k_tree=randn(b, hkv, n, d),
        v_tree=randn(b, hkv, n, d),
        parents=parents,
    )


def bytes_floor(x: dict[str, torch.Tensor]) -> int:
    """Bytes a kernel must move at least: each row's root K/V once, tree Q/K/V once, output once."""
    _, hkv, _, d = x["k_root"].shape
    root_keys = int(x["root_lens"].sum()) * hkv * d * 2
    tree = 2 * x["q"].numel() + x["k_tree"].numel() + x["v_tree"].numel()
    return (root_keys + tree) * x["q"].element_size()


def dense_inputs(x: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """[root | tree] keys and values, and the [B, 1, N, S + N] visibility mask."""
    b, n = x["parents"].shape
    s = x["k_root"].shape[2]
    root = torch.arange(s, device=x["q"].device) < x["root_lens"][:, None]  # [B, S]
    mask = torch.cat([root[:, None].expand(b, n, s), ancestor_mask(x["parents"])], dim=2)
    k = torch.cat([x["k_root"], x["k_tree"]], dim=2)
    v = torch.cat([x["v_root"], x["v_tree"]], dim=2)
    return k, v, mask[:, None]


def prepare_methods(
    x: dict[str, torch.Tensor], cuda: bool
) -> dict[str, Callable[[], torch.Tensor]]:
    """Name -> zero-argument call, with each baseline's own inputs prebuilt."""
    k, v, mask = dense_inputs(x)
    methods = {
        "reference": lambda: tree_attention(**x, backend="torch"),
        # return_lse forces the split path (root matmul + tree mask, merged by log-sum-exp).
        "split": lambda: tree_attention(**x, backend="cpu", return_lse=True)[0],
        "cpu": lambda: tree_attention(**x, backend="cpu"),
        "sdpa-dense": lambda: F.scaled_dot_product_attention(
            x["q"], k, v, attn_mask=mask, enable_gqa=True
        ),
    }
    if cuda:
        from genrec_spec.kernels.tree_attention_triton import launch_tree_attention

        bits = ancestor_bitmask(x["parents"])
        kernel_args = [x[name] for name in ("q", "k_root", "v_root", "root_lens")]
        kernel_args += [x["k_tree"], x["v_tree"], bits, x["q"].shape[-1] ** -0.5]
        methods["triton"] = lambda: tree_attention(**x, backend="triton")
        methods["triton-kernel"] = lambda: launch_tree_attention(*kernel_args)[0]
        methods["flex"] = flex_method(x, k, v)
    return methods


def flex_method(x: dict[str, torch.Tensor], k: torch.Tensor, v: torch.Tensor):
    """Compiled FlexAttention over [root | tree] keys with a block mask built from the same
    visibility rule."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    b, n = x["parents"].shape
    s = x["k_root"].shape[2]
    root_lens, visible = x["root_lens"], ancestor_mask(x["parents"])  # [B], [B, N, N]

    def mask_mod(row, head, q_idx, kv_idx):
        tree_idx = (kv_idx - s).clamp(min=0)
        return (kv_idx < root_lens[row]) | ((kv_idx >= s) & visible[row, q_idx, tree_idx])

    block_mask = create_block_mask(mask_mod, b, None, n, s + n, device=x["q"].device)
    compiled = torch.compile(flex_attention, dynamic=False)
    # The regular kernel: with few query rows "AUTO" picks the decoding kernel, which found no
    # valid config for 8/2 heads and 64 nodes on an H200 (torch 2.11, "NoValidChoicesError").
    options = {"BACKEND": "TRITON"}
    return lambda: compiled(
        x["q"], k, v, block_mask=block_mask, enable_gqa=True, kernel_options=options
    )


def median_seconds(
    fn: Callable[[], torch.Tensor], repeats: int, warmup: int, cuda: bool
) -> tuple[float, torch.Tensor]:  # seconds, the last output
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        out = fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


@dataclass(frozen=True)
class KernelBench:
    """One run's choices; None picks the device's default from BenchConfig."""

    shapes: tuple[str, ...] | None = None  # BxSxN; None: the device's grid (quick: quick_shapes)
    quick: bool = False
    heads: str | None = None  # "Hq/Hkv"
    dtype: str | None = None  # a key of DTYPES
    device: str | None = None  # "cpu" or "cuda"; None: cuda when available


def resolve(
    run: KernelBench, config: BenchConfig
) -> tuple[torch.device, tuple[int, int], torch.dtype]:  # device, (Hq, Hkv), dtype
    """The run's device, heads and dtype, each the device's default where the run leaves it."""
    device = torch.device(run.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    torch.set_num_threads(config.threads)
    heads = run.heads or (config.gpu_heads if cuda else config.cpu_heads)
    hq, hkv = (int(h) for h in heads.split("/"))
    return device, (hq, hkv), DTYPES[run.dtype or (config.gpu_dtype if cuda else config.cpu_dtype)]


def benchmark(
    run: KernelBench = KernelBench(),
    config: BenchConfig = BenchConfig(),
    out: Callable[[str], None] = print,
) -> None:
    """Time every method on every shape x tree of the run and print one line per method (``out``
    receives the lines: a header, the column names, then the rows)."""
    if config.repeats < 1 or config.warmup < 0:
        raise BenchError(
            f"--repeats {config.repeats} / --warmup {config.warmup}",
            "use --repeats >= 1 and --warmup >= 0",
        )
    device, (hq, hkv), dtype = resolve(run, config)
    cuda = device.type == "cuda"
    shapes = run.shapes or (
        config.quick_shapes if run.quick else config.gpu_shapes if cuda else config.cpu_shapes
    )
    cases = [parse_shape(shape, tree) for shape in shapes for tree in config.trees]
    baseline = "sdpa-dense" if cuda else "reference"
    name = describe_device(device)
    out(f"tree attention on {name}: Hq/Hkv {hq}/{hkv}, D {config.head_dim}, {dtype}, "
        f"median of {config.repeats}; speedup over {baseline}")  # fmt: skip
    out(f"{'tree':>8} {'B':>3} {'S':>5} {'N':>4}  {'method':<13} {'ms':>9} {'speedup':>8} "
        f"{'GB/s':>8} {'max err':>8}")  # fmt: skip
    for case in cases:
        x = make_inputs(case, hq, hkv, config.head_dim, dtype, device)
        for line in time_case(case, x, baseline, config, cuda):
            out(line)
        del x


def time_case(
    case: Case, x: dict[str, torch.Tensor], baseline: str, config: BenchConfig, cuda: bool
) -> list[str]:
    """Every method on one case's inputs: a table line each (ms, speedup over ``baseline``,
    GB/s over the bytes floor, max error against the reference), or why it could not run."""
    timed, failed = {}, {}
    for method, fn in prepare_methods(x, cuda).items():
        try:
            timed[method] = median_seconds(fn, config.repeats, config.warmup, cuda)
        except Exception as error:  # torch.compile may find no kernel for a shape
            if method != "flex":
                raise
            failed[method] = f"failed to compile: {type(error).__name__}"
    expected, floor = timed["reference"][1].float(), bytes_floor(x)
    head = f"{case.tree:>8} {case.batch:>3} {case.root:>5} {case.nodes:>4}"
    lines = []
    for method, (seconds, result) in timed.items():
        error = (result.float() - expected).abs().max().item()
        speedup = timed[baseline][0] / seconds
        lines.append(f"{head}  {method:<13} {seconds * 1e3:>9.3f} {speedup:>7.2f}x "
                     f"{floor / seconds / 1e9:>8.2f} {error:>8.1e}")  # fmt: skip
    lines += [f"{head}  {method:<13} {reason}" for method, reason in failed.items()]
    return lines
