"""What machine this is: the CPU's model and SIMD flags, the thread count, the torch build.

CPU fast paths are chosen by measurement, and the measurements are cached under a key of what
they depend on (`machine_key`); every benchmark prints `describe()` so numbers taken on
different machines are never compared blindly. A bottom module like `genrec_spec.errors`: it
imports nothing of the project but `genrec_spec.memory` and `genrec_spec.errors` (two others),
so every layer may use it.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import statistics
import time
from collections.abc import Callable, Hashable
from pathlib import Path

from genrec_spec.errors import GenrecError
from genrec_spec.memory import kept

# The CPU features our kernels' speed turns on (the vector width, bfloat16 and int8 dot
# products, AMX tiles), in the names /proc/cpuinfo gives them.
SIMD_FLAGS = (
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512_bf16",
    "avx512_vnni",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
)


@functools.cache
def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo ({} where there is none)."""
    path = Path("/proc/cpuinfo")
    if not path.is_file():
        return {}
    fields = {}
    for line in path.read_text().splitlines():
        if not line.strip():
            break  # the first processor's block ends here
        name, _, value = line.partition(":")
        fields[name.strip()] = value.strip()
    return fields


def cpu_model() -> str:
    """The CPU's model name, e.g. "AMD EPYC" (platform.processor() is often just "x86_64")."""
    return _cpuinfo().get("model name") or platform.processor() or platform.machine()


def cpu_flags() -> tuple[str, ...]:
    """The flags of `SIMD_FLAGS` this CPU reports, in that order."""
    flags = set(_cpuinfo().get("flags", "").split())
    return tuple(flag for flag in SIMD_FLAGS if flag in flags)


def describe() -> str:
    """One line for a benchmark's header: CPU model and flags, cores, torch threads, torch, and
    whether freed memory is kept (`genrec_spec.memory`)."""
    import torch

    return (
        f"{cpu_model()} ({' '.join(cpu_flags()) or 'no SIMD flags reported'}), "
        f"{os.cpu_count()} cores, {torch.get_num_threads()} torch thread(s), torch "
        f"{torch.__version__}{', freed memory kept' if kept() else ''}"
    )


def describe_device(device: str | object) -> str:
    """`describe()` for a CPU; for a CUDA device its name, SMs, memory and CUDA version too."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return describe()
    props = torch.cuda.get_device_properties(device)
    return (
        f"{props.name} ({props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB, "
        f"CUDA {torch.version.cuda}) on {describe()}"
    )


def finish(device: str | object) -> None:
    """Wait for the device's queued work: a GPU call returns before its kernels end (a no-op on
    a CPU). Timers read after it."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def machine_key(*extra: object) -> str:
    """A digest of what a CPU timing depends on: the CPU model and flags, the torch build, and
    `extra` (the thread count where it matters, shapes, the kernels' version)."""
    import torch

    what = [cpu_model(), cpu_flags(), torch.__version__, *extra]
    return hashlib.sha256(repr(what).encode()).hexdigest()[:20]


def time_in_turns(
    calls: dict[Hashable, Callable[[], object]],
    repeats: int,
    after: Callable[[Hashable], object] = lambda key: None,
) -> dict[Hashable, float]:  # key -> median seconds of its call
    """Time every call `repeats` times, the calls taking turns within each round so that a slow
    spell of a shared machine lands on each alike, the order rotating every round (a call
    may leave the caches warm or cold for the next); a first round warms up (first-use
    allocations and choices) and is not counted. `after(key)` runs untimed after each call."""
    samples: dict[Hashable, list[float]] = {key: [] for key in calls}
    keys = list(calls)
    for round_ in range(repeats + 1):
        shift = round_ % len(keys)
        for key in keys[shift:] + keys[:shift]:
            start = time.perf_counter()
            calls[key]()
            if round_:
                samples[key].append(time.perf_counter() - start)
            after(key)
    return {key: statistics.median(times) for key, times in samples.items()}


def set_threads(threads: int | None) -> None:
    """A command's torch CPU threads (None: torch's default, every core), refused below 1 or
    above the machine's cores: far more ran for minutes, ran out of memory or crashed."""
    import torch

    cores = os.cpu_count() or 1
    if threads is None:
        return
    if not 1 <= threads <= cores:
        raise GenrecError(
            f"--threads {threads} on a machine of {cores} cores", f"pass 1 to {cores}"
        )
    torch.set_num_threads(threads)
