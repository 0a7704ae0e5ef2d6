"""4-bit weights (``models.q4``): Q4_1 codes round-trip, the packed int4 kernel computes the
dequantised matrix's product up to bfloat16 rounding (any N, padded to the kernel's tile), and
the shipped SmolLM2 GGUF's codes are exactly the weights the fp32 target was loaded with."""

import pytest
import torch

from genrec_spec.models.q4 import GROUP, Q4Codes, Q4Error, cat_codes, quantize_q4


def random_matrix(n: int, k: int, seed: int) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed))


def test_quantize_round_trip_within_half_a_step():
    w = random_matrix(24, 64, 0)
    w[3, :GROUP] = 0.7  # a constant group: scale stays finite, the value exact
    q = quantize_q4(w)
    assert q.codes.shape == (24, 64) and q.scales.shape == q.mins.shape == (24, 64 // GROUP)
    assert int(q.codes.min()) >= 0 and int(q.codes.max()) <= 15
    err = (q.dequantize() - w).abs().view(24, 2, GROUP).amax(-1)  # [N, groups]
    assert bool((err <= q.scales / 2 + 1e-6).all())
    assert torch.equal(q.dequantize()[3, :GROUP], w[3, :GROUP])


@pytest.mark.parametrize("n", [16, 40, 61], ids=["tile", "padded", "odd"])
def test_packed_product_matches_dequantised(n):
    q = quantize_q4(random_matrix(n, 96, 1))
    x = random_matrix(3, 96, 2).bfloat16()  # M = 3 rows
    out = q.pack()(x)
    assert out.shape == (3, n) and out.dtype == torch.bfloat16
    expected = x.float() @ q.dequantize().T
    # bf16 scales and output: ~3 significant digits of values of magnitude ~10.
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=0.15)


def test_cat_codes_stacks_outputs():
    parts = [quantize_q4(random_matrix(n, 64, s)) for s, n in enumerate((32, 16, 16))]
    x = random_matrix(2, 64, 9).bfloat16()
    fused = cat_codes(parts).pack()(x)
    torch.testing.assert_close(fused, torch.cat([p.pack()(x) for p in parts], dim=1))


def test_bad_shape_is_refused():
    with pytest.raises(Q4Error, match="groups of 32"):
        quantize_q4(random_matrix(16, 48, 0))


@pytest.mark.slow
def test_smollm2_codes_are_the_loaded_weights():
    """Every Q4_1 matrix of the shipped file, q/k rows un-permuted, dequantises to exactly the
    fp32 weight ``read_gguf`` gives: the draft holds the target's own weights."""
    from genrec_spec.models.llama_loading import read_gguf, read_gguf_q4
    from genrec_spec.models.smollm2 import smollm2_gguf_path

    codes = read_gguf_q4(smollm2_gguf_path())
    _, weights = read_gguf(smollm2_gguf_path())
    assert len(codes) == 7 * 30  # q, k, v, o, gate, up, down of 30 layers; not the Q8_0 table
    assert all(isinstance(c, Q4Codes) for c in codes.values())
    assert all(torch.equal(c.dequantize(), weights[name]) for name, c in codes.items())
