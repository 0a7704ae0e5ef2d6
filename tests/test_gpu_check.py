"""`genrec-spec gpu-check`'s plan and runner on this machine (the GPU checks themselves run where
a GPU is: docs/results/kernels.md, recsys-speed.md)."""

import sys
from pathlib import Path

import pytest
import torch

from genrec_spec.bench import gpu_check

TESTS = Path(__file__).parent


def test_it_collects_only_the_files_with_gpu_tests():
    files = {p.relative_to(TESTS).as_posix() for p in gpu_check.gpu_test_files(TESTS)}
    assert {"kernels/test_tree_attention.py", "recsys/test_bench_recsys.py"} <= files
    assert "test_gpu_check.py" in files  # this file's own GPU test below
    assert "core/test_core_beam.py" not in files


def test_the_plan_runs_tests_first_and_bench_recsys_at_each_width(tmp_path):
    config = gpu_check.GpuCheckConfig(beam_widths=(20, 200), tune_grid="pipeline")
    out, catalogues = tmp_path / "out", tmp_path / "catalogues"
    checks = gpu_check.plan(TESTS, tmp_path / "ckpt", None, out, catalogues, config)
    names = ["tests", "tune", "recsys-w20", "recsys-w200", "llm", "beam", "scale", "kernel"]
    assert [c.name for c in checks] == names
    assert checks[0].argv[1:5] == ["-m", "pytest", "-m", "gpu"]
    assert checks[1].argv[-2:] == ["--grid", "pipeline"]
    recsys = checks[3].argv
    assert recsys[recsys.index("--beam-width") + 1] == "200"
    assert recsys[recsys.index("--device") + 1] == "cuda" and "--data" not in recsys
    llm = checks[4].argv
    assert llm[llm.index("--device") + 1] == "cuda"
    beam = checks[5].argv
    assert beam[beam.index("--device") + 1] == "cuda" and beam[3:5] == ["bench", "beam"]
    scale = checks[6].argv
    assert scale[scale.index("--device") + 1] == "cuda"
    assert scale[scale.index("--data-root") + 1] == str(catalogues)
    assert scale[scale.index("--out") + 1] == str(out / "scale")
    assert sum(c.limit_s for c in checks) < 12 * 60  # the window the issue gives
    without = gpu_check.plan(TESTS, None, None, out, catalogues, config)
    assert [c.name for c in without] == ["tests", "tune", "llm", "beam", "scale", "kernel"]


def test_a_check_keeps_its_output_and_a_cut_check_says_so(tmp_path):
    say = gpu_check.Check("say", [sys.executable, "-c", "print('hello')"], 30)
    fail = gpu_check.Check("fail", [sys.executable, "-c", "raise SystemExit(3)"], 30)
    code = "import time; print('started', flush=True); time.sleep(30)"
    slow = gpu_check.Check("slow", [sys.executable, "-c", code], 2)
    outcomes = [gpu_check.run_check(c, tmp_path) for c in (say, fail, slow)]
    assert [o.status for o in outcomes] == ["ok", "failed (exit 3)", "cut at its limit (2 s)"]
    assert (tmp_path / "say.txt").read_text().endswith("hello\n")
    assert "started" in (tmp_path / "slow.txt").read_text()  # printed before the cut
    assert not list(tmp_path.glob("*.partial"))
    text = gpu_check.summary(outcomes, "a test machine")
    assert "| fail | failed (exit 3) |" in text and text.startswith("# GPU check on a test")
    # A bench's report is summarised from its header on, without its libraries' warnings
    noisy = "print('a library warns'); print('ml-1m test split, 3706 items'); print('beam 1.00x')"
    recsys = gpu_check.run_check(
        gpu_check.Check("recsys-w20", [sys.executable, "-c", noisy], 30), tmp_path
    )
    text = gpu_check.summary([recsys], "a test machine")
    assert "ml-1m test split" in text and "beam 1.00x" in text and "\na library warns" not in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_without_a_gpu_it_refuses_before_any_work(tmp_path):
    with pytest.raises(ValueError, match="no CUDA GPU"):
        gpu_check.gpu_check(tmp_path / "out", None, None, TESTS)
    with pytest.raises(ValueError, match="unknown checks"):
        gpu_check.gpu_check(tmp_path / "out", None, None, TESTS, only={"tests", "llama"})
    assert not (tmp_path / "out").exists()


@pytest.mark.gpu
def test_gpu_machine_reports_its_device():
    from genrec_spec.machine import describe_device

    assert torch.cuda.get_device_name() in describe_device("cuda")
