"""4-bit Llama ops for the CPU (``q4.cpp``, built on first use): x @ W.T with W as 4-bit codes
(``models.llm.q4``), and a Llama's decoder layers for one token per row on such weights.

Why our own kernel: ATen's CPU int4 matmul (``_weight_int4pack_mm_for_cpu``) is bound by
unpacking its nibbles and rounds its scales and output to bfloat16. ``q4.cpp`` lays 16 output
rows across the SIMD lanes and turns each code into the bfloat16 128 + code with one bit
operation, so a single AVX512-BF16 instruction does 32 multiply-adds with nothing left to
unpack (a whole layer stack in sequence is then bound by memory; it prefetches ahead), with
fp16 scales and fp32 sums and output, so it is also closer to the exactly dequantised matrix
than ATen's: ``genrec-spec bench q4`` compares them. CPUs without AVX512-BF16 but with AVX2
(and FMA, F16C) read the same layout with 16-bit integer multiply-adds of the codes by x rounded
to int8 per group of 32 (llama.cpp's activations on such CPUs: exact integer sums, 32 products
an instruction, where fp32 multiply-adds of codes gave 8 and left the loop bound by unpacking);
others get a portable loop over it: the bfloat16 sums, slower. ``rounded_input`` says what x
becomes on the CPU at hand.

The ops are compiled by ``torch.utils.cpp_extension`` for the machine they run on
(-march=native) the first time they are needed (cached under ``$TORCH_EXTENSIONS_DIR``,
by default ~/.cache/torch_extensions) and registered as ``torch.ops.genrec_spec.q4_matmul`` and
``torch.ops.genrec_spec.q4_decode_layers``. The second runs every decoder layer of a Llama for
one token per row on the target's KV cache (``models.llm.quantized_draft``; q4.cpp documents its
arguments): RoPE, the cache writes, attention, SiLU and the residual sums as plain loops around
the matmul. Written as dozens of PyTorch ops a layer (even under TorchScript), those would cost
about as much as the 4-bit products themselves.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from torch import Tensor

SOURCE = Path(__file__).with_name("q4.cpp")


@functools.cache
def load(portable: bool = False) -> None:
    """Build (or reuse the cached build of) the op and register it, once per process: for this
    machine's instruction set, or with ``portable`` for the compiler's baseline (the loop without
    AVX512-BF16, which tests check against the vectorised one). A process holds one of the two."""
    from torch.utils import cpp_extension

    try:
        cpp_extension.load(
            name="genrec_spec_q4" + ("_portable" if portable else ""),
            sources=[str(SOURCE)],
            extra_cflags=["-O3", "-std=c++17", *([] if portable else ["-march=native"])],
            is_python_module=False,
        )
    except (RuntimeError, OSError, FileNotFoundError) as err:
        raise RuntimeError(
            f"could not build the 4-bit ops from {SOURCE} ({err}). It needs a C++ compiler "
            "(g++ or clang++) and ninja (`pip install ninja`) on this machine; the `quant` "
            "method cannot run without it: pick another method (e.g. ngram)"
        ) from err


def q4_matmul(
    x: Tensor,  # [M, K] fp32
    codes: Tensor,  # [N / 16, K / 32, 128] int16, Q4Weight.codes
    scales: Tensor,  # [N / 16, K / 32, 16] fp16
    mins: Tensor,  # [N / 16, K / 32, 16] fp16
    norm: Tensor | None = None,  # [K] fp32: RMS-normalise x's rows with this weight first
    eps: float = 0.0,  # the norm's epsilon
) -> Tensor:  # [M, N] fp32, N a multiple of 16
    load()
    return torch.ops.genrec_spec.q4_matmul(x, codes, scales, mins, norm, eps)


def rounded_input(x: Tensor) -> Tensor:  # [M, K] fp32 -> [M, K] float64
    """x as the op multiplies it on this CPU: rounded to bfloat16, or on the AVX2 path to int8
    per group of 32 with the scale max |x| / 127 (the op is then the dequantised matrix's exact
    product with this, up to fp32 rounding)."""
    if path() != "avx2":
        return x.bfloat16().double()
    groups = x.reshape(x.shape[0], -1, 32)  # [M, G, 32]
    scale = groups.abs().amax(-1, keepdim=True) / 127  # fp32, as the op computes it
    inverse = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    return ((groups * inverse).round().double() * scale.double()).reshape(x.shape)


def path() -> str:
    """Which loop the op was built with for this CPU: "avx512-bf16", "avx2" or "portable"."""
    load()
    return torch.ops.genrec_spec.q4_matmul_path()
