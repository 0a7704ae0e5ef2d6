"""The 4-bit matmul op (``kernels.q4``; its layer stack is tested through the quant draft,
tests/llm/test_quantized_draft.py): equal to the dequantised matrix's product (x rounded as
the CPU's path rounds it, ``rounded_input``, the rest fp32) for every row count (the kernel takes
x 1-8 rows at a time), ragged N, the fused RMS norm and more than one thread; the portable loop
(built in a subprocess: a process registers one build) gives the bfloat16 paths' numbers; bad
input is refused with a message."""

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from genrec_spec.kernels.q4 import path, q4_matmul, rounded_input
from genrec_spec.models.llm.q4 import quantize_q4


def case(n: int, k: int, m: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    codes = quantize_q4(torch.randn(n, k, generator=g))
    return codes, torch.randn(m, k, generator=g)


def reference(codes, x, norm=None, eps=1e-5, rounded=rounded_input):  # [M, K] -> [M, N] f64
    if norm is not None:
        x = F.rms_norm(x, (x.shape[1],), norm, eps)
    return rounded(x) @ codes.dequantize().double().T


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 11])
@pytest.mark.parametrize("n,k", [(16, 32), (61, 96), (40, 576)])
def test_matches_dequantised_product(m, n, k):
    codes, x = case(n, k, m)
    w = codes.pack()
    out = q4_matmul(x, w.codes, w.scales, w.mins)  # [M, N padded]
    assert out.shape == (m, w.codes.shape[0] * 16) and out.dtype == torch.float32
    expected = reference(codes, x)
    tol = 1e-5 * float(expected.abs().max())
    torch.testing.assert_close(out[:, :n].double(), expected, rtol=0, atol=tol)
    assert bool((out[:, n:] == 0).all())  # padding rows: zero codes, zero scales


def test_fused_norm_and_threads():
    codes, x = case(48, 128, 3, seed=1)
    norm = torch.rand(128) + 0.5
    w = codes.pack()
    expected = reference(codes, x, norm)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            out = q4_matmul(x, w.codes, w.scales, w.mins, norm, 1e-5)[:, :48]
            tol = 1e-5 * float(expected.abs().max())
            torch.testing.assert_close(out.double(), expected, rtol=0, atol=tol)
    finally:
        torch.set_num_threads(before)


def test_vectorized_where_the_cpu_allows():
    flags = open("/proc/cpuinfo").read().split() if sys.platform == "linux" else []
    if "avx512_bf16" in flags:
        assert path() == "avx512-bf16"
    elif {"avx2", "fma", "f16c"} <= set(flags):
        assert path() == "avx2"
    else:
        pytest.skip("this CPU has neither AVX512-BF16 nor AVX2: the op runs its portable loop")


PORTABLE = """
import torch
from genrec_spec.kernels import q4 as op
op.load(portable=True)
assert torch.ops.genrec_spec.q4_matmul_path() == "portable"
for codes, scales, mins, x, norm in torch.load({path!r}):
    out = torch.ops.genrec_spec.q4_matmul(x, codes, scales, mins, norm, 1e-5)
    torch.save(out, {path!r} + f".{{len(x)}}")
"""


def test_portable_loop_gives_the_bfloat16_product(tmp_path):
    cases = []
    for m, norm in ((1, None), (6, torch.rand(96) + 0.5)):
        codes, x = case(61, 96, m, seed=m)
        w = codes.pack()
        cases.append((codes, w, x, norm))
    path = str(tmp_path / "cases.pt")
    torch.save([(w.codes, w.scales, w.mins, x, norm) for _, w, x, norm in cases], path)
    subprocess.run([sys.executable, "-c", PORTABLE.format(path=path)], check=True)
    for codes, _, x, norm in cases:
        portable = torch.load(f"{path}.{len(x)}")[:, :61].double()
        expected = reference(codes, x, norm, rounded=lambda x: x.bfloat16().double())
        tol = 1e-5 * float(expected.abs().max())
        torch.testing.assert_close(portable, expected, rtol=0, atol=tol)


def test_bad_input_is_refused():
    codes, x = case(32, 64, 2)
    w = codes.pack()
    with pytest.raises(RuntimeError, match="fp32 matrix"):
        q4_matmul(x.bfloat16(), w.codes, w.scales, w.mins)
    with pytest.raises(RuntimeError, match="do not fit x"):
        q4_matmul(torch.randn(2, 96), w.codes, w.scales, w.mins)
    with pytest.raises(RuntimeError, match="fp16"):
        q4_matmul(x, w.codes, w.scales.float(), w.mins)
    with pytest.raises(RuntimeError, match="norm's weight"):
        q4_matmul(x, w.codes, w.scales, w.mins, torch.ones(32), 1e-5)


def test_bench_q4_times_every_method_on_every_matrix(capsys):
    from genrec_spec.bench.q4 import MATRICES
    from genrec_spec.cli import main

    assert (
        main(["bench", "q4", "--rows", "1,3", "--layers", "1", "--repeats", "1", "--warmup", "0"])
        == 0
    )
    lines = capsys.readouterr().out.splitlines()[2:]
    rows = [line.split() for line in lines]  # matrix, M, method, ms, speedup, Gw/s, max err
    assert {(r[0], r[1], r[2]) for r in rows} == {
        (matrix, m, method)
        for matrix in (*MATRICES, "layers")
        for m in ("1", "3")
        for method in ("q4", "aten-int4", "fp32", "bf16")
    }
    for r in rows:  # fp32 exact up to float rounding; x (and bf16 and ATen's output) ~1e-3
        assert float(r[6]) < (1e-5 if r[2] == "fp32" else 2e-2)
