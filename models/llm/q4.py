"""4-bit weights for drafting on a CPU: llama.cpp's Q4_0 / Q4_1 formats and our int4 kernel.

Q4_1 stores a weight matrix [N, K] in groups of ``GROUP`` consecutive weights along K, each as
4-bit codes c in 0..15 with one scale and one minimum: w = c * scale + min (Q4_0: min = -8
scale). SmolLM2's shipped GGUF holds every layer's matrices as Q4_1, so the fp32 target the
project decodes is exactly those codes dequantised; run at 4 bits, the same model is a draft that
agrees with it on all but the rounding of its activations.

``Q4Codes`` holds the codes as plain tensors (readable, concatenable, exactly dequantisable);
``pack`` lays them out for ``kernels.q4`` (bfloat16 or int8 activations, fp16 scales, fp32 output;
K % GROUP == 0, N padded to a multiple of 16). At one row it is faster than ATen's int4 kernel
and far faster than the fp32 product (``genrec-spec bench q4``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from genrec_spec.errors import GenrecError
from genrec_spec.kernels.q4 import q4_matmul

GROUP = 32  # weights per (scale, min) pair, along K: a Q4_0 / Q4_1 block


class Q4Error(GenrecError):
    """A matrix that cannot be cut into 4-bit groups, or 4-bit codes that do not fit the model
    they are given for."""


@dataclass(frozen=True)
class Q4Codes:
    """A [N, K] matrix as 4-bit codes with a scale and a minimum per group of GROUP along K."""

    codes: Tensor  # [N, K] int32, 0..15
    scales: Tensor  # [N, K / GROUP] fp32 holding fp16 values (as llama.cpp stores them)
    mins: Tensor  # [N, K / GROUP] fp32 holding fp16 values

    def dequantize(self) -> Tensor:  # [N, K] fp32
        n, k = self.codes.shape
        groups = self.codes.view(n, k // GROUP, GROUP).float()
        return (groups * self.scales[..., None] + self.mins[..., None]).view(n, k)

    def pack(self) -> Q4Weight:
        """The layout of ``kernels.q4`` (see q4.cpp): rows in blocks of 16 (N
        padded with zero rows), each group's codes interleaved so that one 16-bit lane holds
        four codes of one row; scales and minima in fp16 with the rows along lanes."""
        n, k = self.codes.shape
        pad, groups = -n % 16, k // GROUP
        codes, scales, mins = (
            F.pad(t, (0, 0, 0, pad)) for t in (self.codes, self.scales, self.mins)
        )
        blocks = (n + pad) // 16
        # weight i of a group is 2 (p + 4 s) + e: [NB, r, G, s, p, e] -> [NB, G, p, r, e, s]
        q = codes.view(blocks, 16, groups, 4, 4, 2).permute(0, 2, 4, 1, 5, 3)
        lanes = sum(q[..., s] << (4 * s) for s in range(4))  # [NB, G, p, r, e] 0 .. 65535
        lanes = torch.where(lanes >= 1 << 15, lanes - (1 << 16), lanes)  # as int16 bits

        def by_lane(t: Tensor) -> Tensor:  # [N + pad, G] -> [NB, G, 16] fp16
            return t.view(blocks, 16, groups).transpose(1, 2).to(torch.float16).contiguous()

        return Q4Weight(
            lanes.to(torch.int16).reshape(blocks, groups, 128).contiguous(),
            by_lane(scales),
            by_lane(mins),
            n,
        )


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
        raise Q4Error(
            f"a [{n}, {k}] matrix cannot be cut into groups of {GROUP} along K",
            f"quantise matrices whose K is a multiple of {GROUP}",
        )
    groups = weight.detach().float().reshape(n, k // GROUP, GROUP)
    low, high = groups.amin(-1), groups.amax(-1)  # [N, K / GROUP]
    # In fp16 (the kernel's), low rounded down and the scale up: the group stays in range.
    low = _fp16_at_most(low)
    scales = -_fp16_at_most(-(high - low) / 15)
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # a constant group
    codes = ((groups - low[..., None]) / scales[..., None]).round().clamp(0, 15)
    return Q4Codes(codes.to(torch.int32).reshape(n, k), scales, low)


def _fp16_at_most(t: Tensor) -> Tensor:  # fp32 -> the largest fp16 value <= t, as fp32
    half = t.half()
    return torch.where(half.float() > t, half.nextafter(half.new_tensor(-torch.inf)), half).float()


@dataclass(frozen=True)
class Q4Weight:
    """A Q4Codes matrix in ``kernels.q4``'s layout."""

    codes: Tensor  # [NB, G, 128] int16, NB = ceil(N / 16), G = K / GROUP
    scales: Tensor  # [NB, G, 16] fp16
    mins: Tensor  # [NB, G, 16] fp16
    out_features: int  # N

    def __call__(self, x: Tensor) -> Tensor:  # [M, K] fp32 -> [M, N] fp32
        return q4_matmul(x, self.codes, self.scales, self.mins).narrow(1, 0, self.out_features)
