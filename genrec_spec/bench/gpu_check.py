"""Every GPU check in one command: ``genrec-spec gpu-check --out DIR`` (``make gpu-check``).

GPU time comes in short windows, so the checks run one after another, each in its own process
with a time limit, most important first, and each writes its output as it goes (a check cut by
its limit keeps what it printed):

1. ``tests``: the GPU-marked tests (every test file that has one), the Triton kernel compiled;
2. ``tune``: ``bench kernel --tune --grid narrow`` (``--tune-grid``), the kernel's launch
   parameters around the default swept on the GPU, timed by CUDA-graph replay against SDPA with
   a dense mask (the full grid, ``--grid full``, takes longer than a short window allows);
3. ``recsys-wN``: ``bench recsys --device cuda --beam-width N`` for each beam width, on a trained
   checkpoint (``--ckpt``): beam, spec_beam and every other decoder on the same users;
4. ``llm``: ``bench llm --device cuda`` on SmolLM2: plain decoding, our drafters that run on a
   GPU (``CPU_ONLY`` left out) and transformers' ``generate``, a few HumanEval prompts;
5. ``beam``: ``bench beam --device cuda`` on SmolLM2, the catalogue-constrained title task at
   W=10: transformers' ``generate``, our plain and speculative beam search (native and through
   ``HFTarget``), a few users (on a GPU a pass's fixed cost is most of it: what drafting saves);
6. ``scale``: ``bench scale --device cuda`` on small synthetic catalogues (prepared on the
   machine's CPU under ``--catalogues``, reused by a later run), every decoder at W 20, 200
   and 512, batch 1 and 64, its report in DIR/scale;
7. ``kernel``: ``bench kernel --device cuda`` on a few shapes, timed by the host clock with each
   call's launch overhead (FlexAttention compiled there too).

DIR gets one ``<check>.txt`` per check and ``summary.md``: each check's exit status, seconds and
command, then the kernel's best launch per shape and the recommender, LLM and scale reports.
Files are written under a temporary name and renamed when their check ends.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from genrec_spec.bench.errors import BenchError


@dataclass(frozen=True)
class GpuCheckConfig:
    """Defaults of ``genrec-spec gpu-check``."""

    beam_widths: tuple[int, ...] = (20, 200)  # bench recsys, one check each
    recsys_users: int = 60  # batch-1 users of each bench recsys
    recsys_batch_sizes: str = "64,256"
    kernel_shapes: tuple[str, ...] = ("32x2048x64", "1x2048x64")  # the host-clock check
    tune_grid: str = "narrow"  # bench kernel --grid
    # Small enough to prepare on the machine inside the check (about a minute each)
    scale_sizes: str = "10000,100000"
    llm_prompts: int = 4
    beam_requests: int = 4
    # Seconds each check may take: under 12 minutes in all. A window shorter than that runs the
    # kinds that fit (``--checks``).
    tests_s: int = 110
    tune_s: int = 90
    recsys_s: int = 70  # each beam width
    llm_s: int = 90
    beam_s: int = 60
    scale_s: int = 150
    kernel_s: int = 40


@dataclass(frozen=True)
class Check:
    name: str
    argv: list[str]
    limit_s: int


@dataclass(frozen=True)
class Outcome:
    check: Check
    status: str  # "ok", "failed (exit N)" or "cut at its limit"
    seconds: float
    output: Path


def gpu_test_files(tests: Path) -> list[Path]:
    """Test files with a GPU-marked test: only these are collected, so the GPU machine needs
    none of the other tests' dependencies (the service's, Ray's)."""
    return sorted(
        p for p in tests.rglob("test_*.py") if "mark.gpu" in p.read_text(encoding="utf-8")
    )


def plan(
    tests: Path,
    ckpt: Path | None,
    data: Path | None,
    out_dir: Path,
    catalogues: Path,
    config: GpuCheckConfig,
) -> list[Check]:
    """The checks in the order they run (module docstring)."""
    cli = [sys.executable, "-m", "genrec_spec.cli"]
    files = [str(p) for p in gpu_test_files(tests)]
    tune = [*cli, "bench", "kernel", "--tune", "--grid", config.tune_grid]
    checks = [
        Check("tests", [sys.executable, "-m", "pytest", "-m", "gpu", "-q", *files], config.tests_s),
        Check("tune", tune, config.tune_s),
    ]
    if ckpt is not None:
        source = [*cli, "bench", "recsys", "--ckpt", str(ckpt), "--device", "cuda"]
        source += ["--data", str(data)] if data is not None else []
        source += ["--users", str(config.recsys_users)]
        source += ["--batch-sizes", config.recsys_batch_sizes]
        for width in config.beam_widths:
            argv = [*source, "--beam-width", str(width)]
            checks.append(Check(f"recsys-w{width}", argv, config.recsys_s))
    llm = [*cli, "bench", "llm", "--device", "cuda", "--n", str(config.llm_prompts)]
    checks.append(Check("llm", [*llm, "--max-new-tokens", "64"], config.llm_s))
    beam = [*cli, "bench", "beam", "--device", "cuda", "--requests", str(config.beam_requests)]
    checks.append(Check("beam", [*beam, "--repeats", "1"], config.beam_s))
    scale = [*cli, "bench", "scale", "--device", "cuda", "--sizes", config.scale_sizes]
    scale += ["--data-root", str(catalogues), "--out", str(out_dir / "scale"), "--repeats", "3"]
    scale += ["--prepare-options", "--long-id-digits 0"]  # no decoder timed reads long IDs
    checks.append(Check("scale", scale, config.scale_s))
    kernel = [*cli, "bench", "kernel", "--device", "cuda", "--trees", "medusa", "--shapes"]
    checks.append(Check("kernel", [*kernel, *config.kernel_shapes], config.kernel_s))
    return checks


def run_check(check: Check, out_dir: Path) -> Outcome:
    """Run one check with its output going to ``<out_dir>/<name>.txt`` as it is printed."""
    output = out_dir / f"{check.name}.txt"
    partial = output.with_suffix(".txt.partial")
    env = os.environ | {"PYTHONUNBUFFERED": "1"}
    env.pop("TRITON_INTERPRET", None)  # compiled kernels on the GPU
    started = time.perf_counter()
    with partial.open("w", encoding="utf-8") as sink:
        sink.write("$ " + " ".join(check.argv) + "\n")
        sink.flush()
        try:
            code = subprocess.run(
                check.argv, stdout=sink, stderr=subprocess.STDOUT, env=env, timeout=check.limit_s
            ).returncode
            status = "ok" if code == 0 else f"failed (exit {code})"
        except subprocess.TimeoutExpired:
            status = f"cut at its limit ({check.limit_s} s)"
    partial.replace(output)
    return Outcome(check, status, time.perf_counter() - started, output)


def summary(outcomes: list[Outcome], machine: str) -> str:
    """summary.md: the table of checks, the kernel's best launches and the recsys tables."""
    lines = [f"# GPU check on {machine}", "", "| check | status | seconds | command |"]
    lines.append("|---|---|---|---|")
    for o in outcomes:
        command = " ".join(o.check.argv[1:]).replace("|", "\\|")
        lines.append(f"| {o.check.name} | {o.status} | {o.seconds:.0f} | `{command}` |")
    for o in outcomes:
        text = o.output.read_text(encoding="utf-8").splitlines()
        if o.check.name == "tests":
            picked = text[-3:]
        elif o.check.name == "tune":
            picked = [line for line in text if line.startswith("best ")]
        elif o.check.name.startswith(("recsys", "llm", "beam", "scale")):  # the report
            heads = {"llm": " on cuda, ", "beam": " on cuda, ", "scale": "bench scale: "}
            head = heads.get(o.check.name, " split, ")
            picked = _report(text, head)
        else:
            continue
        lines += ["", f"## {o.check.name}", "", "```", *picked, "```"]
    return "\n".join(lines) + "\n"


def _report(text: list[str], head: str) -> list[str]:
    """The lines from the first that holds `head` (a bench's report header) on: the warnings
    and progress lines its libraries print before it are left out."""
    start = next(
        (i for i, line in enumerate(text) if head in line and not line.startswith("$ ")),
        len(text),
    )
    return [line for line in text[start:] if not line.startswith("batch ")]


def gpu_check(
    out_dir: Path,
    ckpt: Path | None,
    data: Path | None,
    tests: Path,
    catalogues: Path | None = None,
    config: GpuCheckConfig = GpuCheckConfig(),
    only: set[str] | None = None,
    log=print,
) -> list[Outcome]:
    """Run every check of `plan` (or those of the kinds named in `only`: "tests", "tune",
    "recsys", "llm", "beam", "scale", "kernel") into `out_dir` and write its summary.md; the
    scale check's catalogues go to `catalogues` (default: out_dir/catalogues)."""
    import torch

    from genrec_spec.machine import describe_device

    kinds = {"tests", "tune", "recsys", "llm", "beam", "scale", "kernel"}
    if only is not None and not only <= kinds:
        raise BenchError(f"unknown checks {sorted(only - kinds)}", f"choose from {sorted(kinds)}")
    if not torch.cuda.is_available():
        raise BenchError(
            "gpu-check found no CUDA GPU (torch.cuda.is_available() is False)",
            "run it on a machine with a CUDA GPU and a CUDA build of torch",
        )
    if ckpt is not None and not (ckpt / "manifest.json").is_file():
        raise BenchError(f"--ckpt {ckpt} holds no manifest.json", "pass a `train` output folder")
    out_dir.mkdir(parents=True, exist_ok=True)
    machine = describe_device("cuda")
    outcomes = []
    catalogues = catalogues or out_dir / "catalogues"
    checks = plan(tests, ckpt, data, out_dir, catalogues, config)
    for check in [c for c in checks if only is None or c.name.split("-")[0] in only]:
        log(f"{check.name}: up to {check.limit_s} s")
        outcomes.append(run_check(check, out_dir))
        log(f"{check.name}: {outcomes[-1].status} in {outcomes[-1].seconds:.0f} s")
    partial = out_dir / "summary.md.partial"
    partial.write_text(summary(outcomes, machine), encoding="utf-8")
    partial.replace(out_dir / "summary.md")
    return outcomes
