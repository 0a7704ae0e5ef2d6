"""4-bit weights for drafting on a CPU: llama.cpp's Q4_0 / Q4_1 formats and ATen's int4 kernel.

Q4_1 stores a weight matrix [N, K] in groups of ``GROUP`` consecutive weights along K, each as
4-bit codes c in 0..15 with one scale and one minimum: w = c * scale + min (Q4_0: min = -8
scale). SmolLM2's shipped GGUF holds every layer's matrices as Q4_1, so the fp32 target the
project decodes is exactly those codes dequantised; run at 4 bits, the same model is a draft that
agrees with it on all but the rounding of its activations.

``Q4Codes`` holds the codes as plain tensors (readable, concatenable, exactly dequantisable);
``pack`` lays them out for ATen's CPU int4 matmul (``_weight_int4pack_mm_for_cpu``), which
computes in bfloat16 with w = (c - 8) * scale + zero, so zero = min + 8 * scale. That kernel
needs K % GROUP == 0 (and N % 16 == 0: ``pack`` pads), and is fast in bfloat16 only (fp16 and
fp32 inputs take a reference path ~30x slower here). At one row it computes through SmolLM2's
106M layer weights in ~7 ms (~15G weights/s, bound by unpacking, not memory), where the fp32
weight-major product takes ~25 ms.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

GROUP = 32  # weights per (scale, min) pair, along K: a Q4_0 / Q4_1 block


class Q4Error(ValueError):
    """A matrix that cannot be cut into groups; the message says which shape is needed."""


@dataclass(frozen=True)
class Q4Codes:
    """A [N, K] matrix as 4-bit codes with a scale and a minimum per group of GROUP along K."""

    codes: Tensor  # [N, K] int32, 0..15
    scales: Tensor  # [N, K / GROUP] fp32
    mins: Tensor  # [N, K / GROUP] fp32

    def dequantize(self) -> Tensor:  # [N, K] fp32
        n, k = self.codes.shape
        groups = self.codes.view(n, k // GROUP, GROUP).float()
        return (groups * self.scales[..., None] + self.mins[..., None]).view(n, k)

    def pack(self) -> Q4Weight:
        """The kernel's layout, N padded with zero rows to a multiple of 16 (its tile)."""
        n, k = self.codes.shape
        pad = -n % 16
        codes, scales, mins = (
            F.pad(t, (0, 0, 0, pad)) for t in (self.codes, self.scales, self.mins)
        )
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        zeros = mins + 8 * scales
        scales_zeros = torch.stack([scales.T, zeros.T], dim=-1)  # [K / GROUP, N + pad, 2]
        return Q4Weight(packed, scales_zeros.to(torch.bfloat16).contiguous(), n)


def cat_codes(parts: list[Q4Codes]) -> Q4Codes:
    """Matrices stacked along N (their outputs side by side): one kernel call for several
    projections of the same input, e.g. q, k and v."""
    return Q4Codes(
        *(torch.cat([getattr(p, f) for p in parts]) for f in ("codes", "scales", "mins"))
    )


def quantize_q4(weight: Tensor) -> Q4Codes:  # [N, K] -> codes
    """Round a float matrix to Q4_1 codes (per group: min and (max - min) / 15), for weights
    that do not come as 4-bit codes already (a Hugging Face checkpoint, the tied LM head)."""
    n, k = weight.shape
    if k % GROUP:
        raise Q4Error(f"a [{n}, {k}] matrix cannot be cut into groups of {GROUP} along K")
    groups = weight.detach().float().reshape(n, k // GROUP, GROUP)
    low, high = groups.amin(-1), groups.amax(-1)  # [N, K / GROUP]
    scales = (high - low) / 15
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # a constant group
    codes = ((groups - low[..., None]) / scales[..., None]).round().clamp(0, 15)
    return Q4Codes(codes.to(torch.int32).reshape(n, k), scales, low)


@dataclass(frozen=True)
class Q4Weight:
    """A Q4Codes matrix packed for ``_weight_int4pack_mm_for_cpu``."""

    packed: Tensor  # [N, K / 2] uint8, the kernel's layout
    scales_zeros: Tensor  # [K / GROUP, N, 2] bf16
    out_features: int  # N

    def __call__(self, x: Tensor) -> Tensor:  # [M, K] bf16 -> [M, N] bf16
        return int4_matmul(x, self.packed, self.scales_zeros, self.out_features)


def int4_matmul(
    x: Tensor,  # [M, K] bf16
    packed: Tensor,  # Q4Weight.packed
    scales_zeros: Tensor,  # Q4Weight.scales_zeros
    n: int,  # output features; the kernel's output may be padded past them
    group: int = GROUP,
) -> Tensor:  # [M, n] bf16
    """The kernel call (TorchScript-compatible, for ``quantized_draft``'s layer loop)."""
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, scales_zeros)
    return out if out.shape[1] == n else out.narrow(1, 0, n)
