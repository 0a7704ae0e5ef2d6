"""Benchmark of the 4-bit CPU matmul (``kernels.q4``): ``genrec-spec bench q4``.

On SmolLM2-135M's matrix shapes (q/k/v fused, wo, gate/up fused, down, the LM head), with random
Q4_1 codes, for each row count it times side by side in one run:

- ``q4``: our op (``Q4Weight``: x rounded inside, to bfloat16 or on the AVX2 path to int8 per
  group of 32, ``kernels.q4.rounded_input``; fp16 scales, fp32 output);
- ``aten-int4``: ATen's CPU int4 matmul (``_weight_int4pack_mm_for_cpu``, what the quant draft
  used before: bfloat16 scales and output), its input already bfloat16 (its best case);
- ``fp32``: ``F.linear`` on the dequantised matrix (what the fp32 target does);
- ``bf16``: ``F.linear`` on the dequantised matrix and x both rounded to bfloat16 (bfloat16
  output): oneDNN's kernel, on AMX tiles where the CPU has them (``amx_bf16`` among the flags
  printed), AVX512-BF16 otherwise. A draft's output need not be fp32, so this is the other way a
  draft could use the CPU's bfloat16 units: twice the 4-bit codes' bytes, far more arithmetic a
  cycle.

``layers`` runs every layer matrix of the model in sequence (30 layers x 4), as a draft step
does: ~84 MB of codes and scales that do not stay in cache, where one matrix alone does. Times
are medians over repeats; ``speedup`` is over aten-int4; ``Gw/s`` is weights per second;
``max err`` is the largest absolute difference from the float64 product of the fp32 input and the
dequantised matrix, relative to the largest output: what each method's rounding of x (and
ATen's of its scales and output) costs.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from genrec_spec.bench.errors import BenchError
from genrec_spec.bench.kernel import median_seconds
from genrec_spec.kernels.q4 import path
from genrec_spec.machine import describe
from genrec_spec.models.llm.q4 import Q4Codes, quantize_q4

# SmolLM2-135M: dim 576, 9 query / 3 key-value heads of 64, FFN 1536, vocabulary 49,152.
MATRICES = {
    "qkv": (960, 576),
    "wo": (576, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
    "head": (49152, 576),
}
LAYER_MATRICES = ("qkv", "wo", "gate_up", "down")


def aten_int4(codes: Q4Codes) -> Callable[[torch.Tensor], torch.Tensor]:  # bf16 [M, K] -> [M, N]
    """ATen's int4 kernel on the same codes: w = (c - 8) * scale + zero, zero = min + 8 scale."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.codes, 1)
    zeros = codes.mins + 8 * codes.scales
    scales_zeros = torch.stack([codes.scales.T, zeros.T], dim=-1).to(torch.bfloat16).contiguous()
    return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, scales_zeros)


def methods_for(codes: list[Q4Codes]) -> dict[str, Callable]:
    """Each method as a function of x, {K: [M, K] fp32}, and its bfloat16 copy xb, running every
    matrix in ``codes`` on the x of its input size."""
    ours = [(c.codes.shape[1], c.pack()) for c in codes]
    aten = [(c.codes.shape[1], aten_int4(c)) for c in codes]
    dense = [(c.codes.shape[1], c.dequantize()) for c in codes]
    half = [(k, w.bfloat16()) for k, w in dense]
    return {
        "q4": lambda x, xb: [w(x[k]) for k, w in ours],
        "aten-int4": lambda x, xb: [w(xb[k]) for k, w in aten],
        "fp32": lambda x, xb: [F.linear(x[k], w) for k, w in dense],
        "bf16": lambda x, xb: [F.linear(xb[k], w) for k, w in half],
    }


@dataclass(frozen=True)
class Q4BenchConfig:
    """Defaults of ``genrec-spec bench q4``."""

    rows: tuple[int, ...] = (1, 8)  # rows of x (batch sizes)
    layers: int = 30  # layers in the `layers` case
    repeats: int = 20  # timed calls per method; the median is reported
    warmup: int = 3  # untimed calls first
    threads: int = 1  # torch CPU threads


def benchmark(config: Q4BenchConfig = Q4BenchConfig(), out: Callable[[str], None] = print) -> None:
    """Time every method on every matrix (and the ``layers`` sequence) for each row count and
    print one line per method (``out`` receives the lines: a header, the column names, the
    rows)."""
    if config.repeats < 1 or config.layers < 1 or min(config.rows, default=0) < 1:
        raise BenchError(
            f"--repeats {config.repeats}, --layers {config.layers}, --rows {config.rows}",
            "--repeats, --layers and --rows must be >= 1",
        )
    torch.set_num_threads(config.threads)
    generator = torch.Generator().manual_seed(0)

    def random_codes(name: str) -> Q4Codes:
        return quantize_q4(torch.randn(MATRICES[name], generator=generator) * 0.05)

    cases = {name: [random_codes(name)] for name in MATRICES}
    cases["layers"] = [random_codes(m) for _ in range(config.layers) for m in LAYER_MATRICES]
    out(f"4-bit matmul ({path()} loop) on {describe()}, SmolLM2-135M's shapes (layers: "
        f"{config.layers} x {len(LAYER_MATRICES)} matrices), median of {config.repeats}; "
        "speedup over aten-int4")  # fmt: skip
    out(f"{'matrix':>8} {'M':>3}  {'method':<10} {'ms':>8} {'speedup':>8} {'Gw/s':>7} "
        f"{'max err':>8}")  # fmt: skip
    for name, codes in cases.items():
        methods = methods_for(codes)
        for m in config.rows:
            for line in time_rows(name, codes, methods, m, config, generator):
                out(line)


def time_rows(
    name: str,
    codes: list[Q4Codes],
    methods: dict[str, Callable],
    m: int,
    config: Q4BenchConfig,
    generator: torch.Generator,
) -> list[str]:
    """Every method on random x of ``m`` rows: a table line each (ms, speedup over aten-int4,
    weights per second, max error relative to the largest exact output)."""
    weights = sum(c.codes.numel() for c in codes)
    sizes = {c.codes.shape[1] for c in codes}
    x = {k: torch.randn(m, k, generator=generator) for k in sizes}  # [M, K] per K
    xb = {k: v.bfloat16() for k, v in x.items()}
    exact = [x[c.codes.shape[1]].double() @ c.dequantize().double().T for c in codes]
    scale = max(float(e.abs().max()) for e in exact)
    timed = {
        method: median_seconds(lambda f=f: f(x, xb), config.repeats, config.warmup, False)
        for method, f in methods.items()
    }
    lines = []
    for method, (seconds, outs) in timed.items():
        error = max(float((o.double() - e).abs().max()) for o, e in zip(outs, exact, strict=True))
        lines.append(f"{name:>8} {m:>3}  {method:<10} {seconds * 1e3:>8.3f} "
                     f"{timed['aten-int4'][0] / seconds:>7.2f}x {weights / seconds / 1e9:>7.1f} "
                     f"{error / scale:>8.1e}")  # fmt: skip
    return lines
