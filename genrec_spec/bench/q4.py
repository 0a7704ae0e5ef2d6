"""Benchmark of the 4-bit CPU matmul (``kernels.q4``): ``genrec-spec bench q4``.

On SmolLM2-135M's matrix shapes (q/k/v fused, wo, gate/up fused, down, the LM head), with random
Q4_1 codes, for each row count it times side by side in one run:

- ``q4``: our op (``Q4Weight``: x rounded to bfloat16 inside, fp16 scales, fp32 output);
- ``aten-int4``: ATen's CPU int4 matmul (``_weight_int4pack_mm_for_cpu``, what the quant draft
  used before: bfloat16 scales and output), its input already bfloat16 (its best case);
- ``fp32``: ``F.linear`` on the dequantised matrix (what the fp32 target does).

``layers`` runs every layer matrix of the model in sequence (30 layers x 4), as a draft step
does: ~84 MB of codes and scales that do not stay in cache, where one matrix alone does. Times
are medians over repeats; ``speedup`` is over aten-int4; ``Gw/s`` is weights per second;
``max err`` is the largest absolute difference from the float64 product of the bfloat16-rounded
input and the dequantised matrix, relative to the largest output.
"""

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F

from genrec_spec.bench.kernel import median_seconds
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
    """Each method as a function of x, {K: [M, K] fp32}, running every matrix in ``codes`` on
    the x of its input size (bfloat16 copies prepared for ATen's kernel)."""
    ours = [(c.codes.shape[1], c.pack()) for c in codes]
    aten = [(c.codes.shape[1], aten_int4(c)) for c in codes]
    dense = [(c.codes.shape[1], c.dequantize()) for c in codes]
    return {
        "q4": lambda x, xb: [w(x[k]) for k, w in ours],
        "aten-int4": lambda x, xb: [w(xb[k]) for k, w in aten],
        "fp32": lambda x, xb: [F.linear(x[k], w) for k, w in dense],
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", default="1,8", help="rows of x (batch sizes), comma-separated")
    parser.add_argument("--layers", type=int, default=30, help="layers in the `layers` case")
    parser.add_argument("--repeats", type=int, default=20, help="timed calls (>= 1)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")


def run(args: argparse.Namespace) -> int:
    rows = [int(r) for r in args.rows.split(",")]
    if args.repeats < 1 or args.layers < 1 or min(rows) < 1:
        raise ValueError("--repeats, --layers and --rows must be >= 1")
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)

    def random_codes(name: str) -> Q4Codes:
        return quantize_q4(torch.randn(MATRICES[name], generator=generator) * 0.05)

    cases = {name: [random_codes(name)] for name in MATRICES}
    cases["layers"] = [random_codes(m) for _ in range(args.layers) for m in LAYER_MATRICES]
    print(f"4-bit matmul on cpu, {args.threads} thread(s), SmolLM2-135M's shapes (layers: "
          f"{args.layers} x {len(LAYER_MATRICES)} matrices), median of {args.repeats}; "
          "speedup over aten-int4")  # fmt: skip
    print(f"{'matrix':>8} {'M':>3}  {'method':<10} {'ms':>8} {'speedup':>8} {'Gw/s':>7} "
          f"{'max err':>8}")  # fmt: skip
    for name, codes in cases.items():
        weights = sum(c.codes.numel() for c in codes)
        methods = methods_for(codes)
        for m in rows:
            sizes = {c.codes.shape[1] for c in codes}
            x = {k: torch.randn(m, k, generator=generator) for k in sizes}  # [M, K] per K
            xb = {k: v.bfloat16() for k, v in x.items()}
            exact = [xb[c.codes.shape[1]].double() @ c.dequantize().double().T for c in codes]
            scale = max(float(e.abs().max()) for e in exact)
            timed = {
                method: median_seconds(
                    lambda f=f, x=x, xb=xb: f(x, xb), args.repeats, args.warmup, False
                )
                for method, f in methods.items()
            }
            for method, (seconds, outs) in timed.items():
                error = max(
                    float((o.double() - e).abs().max()) for o, e in zip(outs, exact, strict=True)
                )
                print(f"{name:>8} {m:>3}  {method:<10} {seconds * 1e3:>8.3f} "
                      f"{timed['aten-int4'][0] / seconds:>7.2f}x {weights / seconds / 1e9:>7.1f} "
                      f"{error / scale:>8.1e}")  # fmt: skip
    return 0
