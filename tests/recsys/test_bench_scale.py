"""`genrec-spec bench scale` on a tiny synthetic catalogue: prepared in a child process with its
cost recorded, reused on the next run, every decoder timed at batch 1 and 2, the report written."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch

from genrec_spec.bench.errors import BenchError
from genrec_spec.bench.scale import BenchScaleConfig, bench_scale
from genrec_spec.bench.scale_report import format_text, write


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_bench_scale_on_a_tiny_catalogue(tmp_path, device):
    settings = BenchScaleConfig(
        sizes=(600,),
        data_root=str(tmp_path / "data"),
        prepare_options=("--codebook-size", "16", "--long-id-digits", "0"),
        beam_widths=(10, 12),
        batch_sizes=(1, 2),
        repeats=1,
        recall_users=4,
        device=device,
    )
    header, (report,) = bench_scale(settings)
    if device == "cuda":
        assert torch.cuda.get_device_name() in header
    assert report.items == 600 and report.levels == 4  # 3 levels + the collision code
    assert report.prepare.measured and report.prepare.peak_rss_bytes > 0
    assert report.trie_bytes_per_item > 0 and report.model_bytes > 0
    assert 0.0 <= report.recall_at_k <= 1.0
    # beam and spec_beam at each width, dense and dense-index once, at each batch size
    assert len(report.cells) == 2 * (2 * 2 + 2)
    assert all(c.latency_ms > 0 and c.calls == 1 for c in report.cells)
    text = format_text(header, [report])
    assert "dense-index" in text and "random-weight" in text
    assert "one call only" not in text  # no cell was too slow to repeat
    slow = replace(report, cells=[replace(report.cells[0], note="one call"), *report.cells[1:]])
    assert "one call only" in format_text(header, [slow])
    written = write(header, [report], settings, tmp_path / "out")
    saved = json.loads((tmp_path / "out" / "scale.json").read_text())
    assert saved["sizes"][0]["items"] == 600 and tmp_path / "out" / "scale.md" in written

    # A second run reuses the folder and its recorded cost; plain code heads read no item
    # windows, so the model loses the tied levels' tables; dense-index searches an HNSW graph.
    heads = replace(
        settings, model="code-heads", beam_widths=(10,), batch_sizes=(2,), index_kind="hnsw"
    )
    header, (again,) = bench_scale(heads)
    assert not again.prepare.measured and "code levels: code-heads" in header
    assert "dense-index: hnsw" in header and 0.0 <= again.recall_at_k <= 1.0
    assert again.prepare.wall_s == report.prepare.wall_s
    assert len(again.cells) == 2 + 2 and all(c.latency_ms > 0 for c in again.cells)


def test_bad_settings_raise():
    with pytest.raises(BenchError, match="unknown decoders"):
        BenchScaleConfig(decoders=("beam", "tiger"))
    with pytest.raises(BenchError, match="model 'tiger'"):
        BenchScaleConfig(model="tiger")
    with pytest.raises(BenchError, match="index kind 'annoy'"):
        BenchScaleConfig(index_kind="annoy")
    with pytest.raises(BenchError, match="must be >= k"):
        BenchScaleConfig(beam_widths=(5,), k=10)
    with pytest.raises(BenchError, match="at least one decoder, and each size once"):
        BenchScaleConfig(decoders=())
    with pytest.raises(BenchError, match="at least one decoder, and each size once"):
        BenchScaleConfig(sizes=(10_000, 10_000))
    with pytest.raises(BenchError, match="larger than the 1,000 users of 10,000"):
        BenchScaleConfig(sizes=(10_000, 100_000), batch_sizes=(1, 2000))  # (an IndexError)
    with pytest.raises(BenchError, match="cores"):
        BenchScaleConfig(threads=100_000)  # (a segfault)
    for limits in ({"max_gather_gib": -1.0}, {"max_gather_gib": math.nan}, {"max_call_s": 0.0}):
        with pytest.raises(BenchError, match="finite limit"):
            BenchScaleConfig(**limits)  # (every cell skipped, or the limit off)
    with pytest.raises(BenchError, match="seed in 0"):
        BenchScaleConfig(seed=2**70)
    with pytest.raises(BenchError, match="--levels 100 must be 1 to"):
        BenchScaleConfig(levels=100)  # (prepared for minutes)
    with pytest.raises(BenchError, match="--device tpu: not a device"):
        BenchScaleConfig(device="tpu")


@pytest.mark.parametrize(
    "options", [("--dataset", "ml-100k"), ("--levels", "2"), ("--out=/x",), ("--ou", "x"), ("-h",)]
)
def test_prepare_options_cannot_override_what_the_bench_sets(options):
    """argparse takes a flag's last value and any unambiguous prefix of its name: these made the
    bench measure another catalogue than its report names (ML-100K reported as 10,000 items)."""
    with pytest.raises(BenchError, match="which bench scale sets itself"):
        BenchScaleConfig(prepare_options=options)


def test_prepare_options_may_start_with_a_dash_without_an_equals_sign(tmp_path, capsys):
    """`--prepare-options --overwrite` got argparse's "expected one argument" (it reads a value
    that starts with a dash as the next option); the value is now the options, checked as any."""
    from genrec_spec.cli import main

    argv = ["bench", "scale", "--sizes", "10", "--out", str(tmp_path / "out")]
    assert main([*argv, "--prepare-options", "--overwrite"]) == 2
    assert "--prepare-options holds --overwrite" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_unwritable_folders_are_refused_before_any_work(tmp_path):
    from genrec_spec.cli import main

    (tmp_path / "file").write_text("")
    common = ["bench", "scale", "--sizes", "600", "--decoders", "beam", "--beam-widths", "10"]
    assert main([*common, "--out", str(tmp_path / "file")]) == 2  # (after every size before)
    assert main([*common, "--data-root", str(tmp_path / "file" / "sub")]) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_a_copied_catalogue_is_read_where_it_is_now(tmp_path):
    from genrec_spec.bench.scale_prepare import folder_of, prepared_catalogue

    folder = folder_of(tmp_path / "copy", 600, 3)
    folder.mkdir(parents=True)
    (folder / "manifest.json").write_text("{}")
    record = {"items": 600, "folder": "/elsewhere/synthetic-600-L3", "wall_s": 1.5}
    record |= {"peak_rss_bytes": 1, "command": "genrec-spec prepare"}
    folder.with_name(folder.name + ".prepare-cost.json").write_text(json.dumps(record))
    cost = prepared_catalogue(600, tmp_path / "copy", 3)
    assert cost.folder == str(folder) and cost.wall_s == 1.5 and not cost.measured


def test_the_gather_limit_follows_the_device():
    from genrec_spec.bench.scale import gather_limit_gib

    assert gather_limit_gib(BenchScaleConfig()) == 4.0  # a CPU machine's default
    assert gather_limit_gib(BenchScaleConfig(max_gather_gib=40.0)) == 40.0
    if torch.cuda.is_available():
        assert gather_limit_gib(BenchScaleConfig(device="cuda")) > 4.0


def test_a_failing_size_keeps_the_report_of_the_sizes_before_it(tmp_path):
    """The report is written after every size: a later size prepare refuses (fewer items than
    its codebook's codes) used to lose the measurements of every size before it."""
    from genrec_spec.cli import main

    out = tmp_path / "out"
    argv = ["bench", "scale", "--sizes", "600,12", "--decoders", "beam", "--beam-widths", "10"]
    argv += ["--batch-sizes", "1", "--repeats", "1", "--data-root", str(tmp_path / "data")]
    argv += ["--prepare-options=--codebook-size 16 --long-id-digits 0", "--out", str(out)]
    assert main(argv) == 2
    report = json.loads((out / "scale.json").read_text())
    assert [size["items"] for size in report["sizes"]] == [600]
    assert "600" in (out / "scale.md").read_text()
