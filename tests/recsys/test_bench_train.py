"""`genrec-spec bench train` on the tiny data: the baseline and a variant take turns, each timed
over its steps, the profile printed; bad settings are refused."""

from __future__ import annotations

import argparse

import pytest

from genrec_spec.bench.errors import BenchError
from genrec_spec.bench.train import BenchTrainConfig
from genrec_spec.cli.bench_train import add_arguments, run

TINY = '{"model": {"dim": 16, "layers": 2, "heads": 2, "max_len": 12}, "train": {"threads": 1}}'


def _cli(args: list[str]) -> int:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return run(parser.parse_args(args))


def test_bench_train_times_the_baseline_and_a_variant(tiny_data_dir, tmp_path, capsys):
    config = tmp_path / "tiny.json"
    config.write_text(TINY)
    common = ["--data", str(tiny_data_dir), "--config", str(config), "--warmup", "1"]
    assert _cli([*common, "--steps", "3", "--block", "2", "--against", "train.batch_size=8"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith(("baseline", "train."))]
    assert [r[0] for r in rows] == ["baseline", "train.batch_size=8"]
    assert 8 < float(rows[0][1]) <= 16 and 0 < float(rows[1][1]) <= 8  # users per step
    assert rows[0][-1] == "1.00x" and all(float(r[2]) > 0 for r in rows)  # seq/s

    assert _cli([*common, "--steps", "1", "--profile", "1"]) == 0
    assert "top operators over 1 steps" in capsys.readouterr().out


def test_bench_train_refuses_bad_settings(tiny_data_dir):
    with pytest.raises(BenchError, match="SECTION.KEY=VALUE"):
        _cli(["--data", str(tiny_data_dir), "--against", "batch_size=8"])
    with pytest.raises(BenchError, match="steps 0"):
        BenchTrainConfig(steps=0)
