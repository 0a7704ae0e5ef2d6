"""The CPU linear's paths and how one is chosen (``models.llm.cpu_linear``): every path gives
F.linear's product up to float rounding, for any row count and layout; a measured choice is
kept in a file per machine key and made again for another CPU or thread count; the modes are
checked. (Decoding under each forced path: tests/core/test_cpu_linear_exactness.py.)"""

import pytest
import torch
import torch.nn.functional as F

from genrec_spec.models.llm import cpu_linear
from genrec_spec.models.llm.llama import LlamaError

PATHS = cpu_linear.available_paths()


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch, linear_mode):
    """An empty cache folder, small timings, and no table left from another test."""
    monkeypatch.setenv("GENREC_SPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_linear, "STREAM_BYTES", 1 << 16)
    monkeypatch.setattr(cpu_linear, "REPEATS", 1)
    linear_mode("measure")
    return tmp_path / "cpu_linear"


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("shape", [(1,), (2,), (3,), (1, 1), (2, 3), (4, 5), (40,), (1, 130)])
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "transposed-view"])
def test_every_path_gives_f_linear(path, shape, strided, linear_mode):
    linear_mode(path)
    gen = torch.Generator().manual_seed(len(shape))
    x = torch.randn(*shape, 24, generator=gen)  # [..., in]
    if strided:  # the same values, laid out as a transposed view
        x = x.reshape(-1, 24).T.contiguous().T.reshape(*shape, 24)
    weight = torch.randn(40, 24, generator=gen)  # [out, in]
    with torch.no_grad():
        out = cpu_linear.linear(x, weight)
    assert out.shape == (*shape, 40) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, weight))


def test_gradients_take_f_linear(linear_mode):
    linear_mode("weight_major")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 24, generator=gen, requires_grad=True)
    weight = torch.randn(40, 24, generator=gen, requires_grad=True)
    out = cpu_linear.linear(x, weight)
    expected = F.linear(x, weight)
    grads = torch.autograd.grad(out.square().sum(), (x, weight))
    torch.testing.assert_close(grads, torch.autograd.grad(expected.square().sum(), (x, weight)))


def test_packed_weights_follow_updates(linear_mode):
    if "packed" not in PATHS:
        pytest.skip("this torch build has no oneDNN")
    linear_mode("packed")
    gen = torch.Generator().manual_seed(1)
    x, weight = torch.randn(5, 24, generator=gen), torch.randn(40, 24, generator=gen)
    with torch.no_grad():
        cpu_linear.linear(x, weight)
        packed = cpu_linear.packed_weight(weight)
        cpu_linear.linear(x, weight)
        assert cpu_linear.packed_weight(weight) is packed  # packed once
        weight.mul_(-2.0)  # an optimiser step or load_state_dict: packed again
        torch.testing.assert_close(cpu_linear.linear(x, weight), F.linear(x, weight))
        assert cpu_linear.packed_weight(weight) is not packed


def test_a_choice_is_measured_once_and_kept_per_machine(fresh_cache, monkeypatch):
    timed = []
    original = cpu_linear.time_paths

    def counting(shape, rows):
        timed.append((shape, rows))
        return original(shape, rows)

    monkeypatch.setattr(cpu_linear, "time_paths", counting)
    for rows in (1, 3, 3, 4):  # 3 and 4 share a bucket
        assert cpu_linear.choice((48, 32), rows) in PATHS
    assert timed == [((48, 32), 1), ((48, 32), 4)]
    (file,) = fresh_cache.glob("*.json")
    cpu_linear.forget()  # a new process: read from the file, nothing timed
    cpu_linear.choice((48, 32), 1)
    assert len(timed) == 2

    before = torch.get_num_threads()  # another thread count: another key, measured again
    try:
        torch.set_num_threads(2 if before != 2 else 1)
        cpu_linear.choice((48, 32), 1)
    finally:
        torch.set_num_threads(before)
    assert len(timed) == 3 and len(list(fresh_cache.glob("*.json"))) == 2

    monkeypatch.setattr("genrec_spec.machine.cpu_model", lambda: "another CPU")
    cpu_linear.forget()
    cpu_linear.choice((48, 32), 1)  # another CPU: measured again
    assert len(timed) == 4 and len(list(fresh_cache.glob("*.json"))) == 3
    assert file.exists()


def test_measured_choice_is_the_fastest_path(fresh_cache, monkeypatch):
    times = dict(zip(PATHS, (3.0, 1.0, 2.0)[: len(PATHS)], strict=True))
    monkeypatch.setattr(cpu_linear, "time_paths", lambda shape, rows: times)
    assert cpu_linear.choice((16, 8), 1) == "weight_major"
    cpu_linear.measure_shapes([(16, 8)])
    assert len(cpu_linear.table(torch.get_num_threads()).entries) == len(cpu_linear.BUCKETS)
    lines = cpu_linear.summary([(16, 8)])
    assert lines == [
        "cpu linear 16x8, rows:path  "
        + " ".join(f"{rows}:weight_major" for rows in cpu_linear.BUCKETS)
    ]


def test_a_near_tie_keeps_f_linear():
    """Another path is chosen only when it beats F.linear by more than the margin."""
    slower = 1 - cpu_linear.MARGIN / 2
    assert cpu_linear.fastest({"linear": 1.0, "weight_major": slower}) == "linear"
    faster = 1 - 2 * cpu_linear.MARGIN
    assert cpu_linear.fastest({"linear": 1.0, "weight_major": 1.5, "packed": faster}) == "packed"


def test_modes(fresh_cache, linear_mode):
    linear_mode("off")
    assert cpu_linear.choice((48, 32), 1) == "linear"
    cpu_linear.measure_shapes([(48, 32)])
    assert not fresh_cache.exists()  # off: nothing measured, nothing written
    assert cpu_linear.summary([(48, 32)]) == [
        f"cpu linear: off for every product ({cpu_linear.MODE_ENV})"
    ]
    linear_mode("fastest")
    with pytest.raises(LlamaError, match="not a mode"):
        cpu_linear.choice((48, 32), 1)


def test_linear_remembers_its_choice_and_follows_the_mode(fresh_cache, monkeypatch, linear_mode):
    timed = []
    original = cpu_linear.time_paths
    monkeypatch.setattr(
        cpu_linear, "time_paths", lambda shape, rows: timed.append(rows) or original(shape, rows)
    )
    x, weight = torch.randn(3, 32), torch.randn(48, 32)
    for _ in range(3):
        torch.testing.assert_close(cpu_linear.linear(x, weight), F.linear(x, weight))
    assert timed == [4]  # chosen once, for 3 rows' bucket
    used = []
    forced = lambda x, weight: used.append(x.shape[0]) or F.linear(x, weight)  # noqa: E731
    monkeypatch.setitem(cpu_linear.PRODUCTS, "weight_major", forced)
    linear_mode("weight_major")
    cpu_linear.linear(x, weight)
    assert used == [3]
