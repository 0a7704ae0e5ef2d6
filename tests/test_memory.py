"""Freed memory kept for reuse (genrec_spec.memory): measured by the page faults of allocating
the same large tensors again, in a fresh process each (the setting is process-wide)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from genrec_spec.cli import RETURN_FREED_MEMORY

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
    reason="mallopt is glibc's",
)

# A history pass's attention at batch 128 (its scores and their SiLU: 40 MB each, above any
# mmap threshold), six times to warm up, then three times, in the main thread and in a worker
# thread (a server's model thread); printed: the minor page faults of each thread's last three.
# When freed memory is given back, every call faults its tensors' pages in again.
SCRIPT = """
import json, resource, sys, threading, torch
import torch.nn.functional as F
from genrec_spec import memory
kept = memory.keep_freed_memory() if sys.argv[1] == "keep" else False
torch.set_num_threads(1)
x = torch.randn(128, 2, 200, 32)  # [B, H, T, D]
def faults():
    # The first calls fault their pages in either way, and the heap settles: an allocation
    # (64-byte aligned, so a little larger) fits a freed block once freed neighbours merged
    for _ in range(6):
        F.silu(x @ x.transpose(-1, -2)) @ x
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    for _ in range(3):
        F.silu(x @ x.transpose(-1, -2)) @ x
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before
main, out = faults(), {}
worker = threading.Thread(target=lambda: out.update(thread=faults()))
worker.start()
worker.join()
print(json.dumps({"kept": kept, "reported": memory.kept(), "main": main, **out}))
"""


def run(mode: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_freed_memory_is_reused_in_main_and_worker_threads():
    given_back, kept = run("default"), run("keep")
    assert not given_back["kept"] and not given_back["reported"]
    assert kept["kept"] and kept["reported"]
    pages = 3 * 2 * 128 * 2 * 200 * 200 * 4 // 4096  # three calls' two 40 MB tensors
    # Given back: every round faults its pages in again; kept: (almost) none
    assert given_back["main"] > pages // 2 and given_back["thread"] > pages // 2
    assert kept["main"] < pages // 50 and kept["thread"] < pages // 50


def test_commands_keep_freed_memory_but_prepare_and_bench_scale():
    script = (
        "import sys; from genrec_spec import cli, memory\n"
        "try:\n    cli.main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
        "print(memory.kept())"
    )

    def kept_after(*argv: str, environ: dict[str, str] | None = None) -> str:
        done = subprocess.run(
            [sys.executable, "-c", script, *argv],
            capture_output=True,
            text=True,
            check=False,
            env={**os.environ, **(environ or {})},
        )
        return done.stdout.strip().splitlines()[-1]

    # Bad input ends both commands before any work, after the setting is made (or not)
    evaluate = ("evaluate", "--ckpt", "/nonexistent", "--data", "/nonexistent")
    assert kept_after(*evaluate) == "True"
    assert kept_after("prepare", "--dataset", "nonexistent", "--out", "/nonexistent") == "False"
    assert kept_after("bench", "scale", "--sizes", "10", "--data-root", "/proc/none") == "False"
    assert kept_after(*evaluate, environ={RETURN_FREED_MEMORY: "1"}) == "False"
