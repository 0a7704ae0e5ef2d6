"""Freed memory kept in the process, so large tensors reuse pages instead of faulting in new ones.

glibc's malloc hands an allocation above its mmap threshold (128 KiB, raised as it runs up to
32 MiB) fresh pages from the kernel and gives them back on free, and it trims the heap's free
top; an allocation in a thread other than the main one comes from that thread's own arena, whose
heaps are capped in size, so a large one is mapped afresh there too. A batched decode allocates
and frees hundreds of MB of activations (attention scores, the history pass's layers) a call, so
every page of them is faulted in and zeroed by the kernel again on every call, in system time
that can exceed the arithmetic's (measured: docs/results/recsys-speed.md, "Freed memory kept").
`keep_freed_memory` turns this off for the whole process: every allocation comes from the main
heap, and what is freed stays there for the next call.

The cost is that the process keeps its peak: after a large batch its resident memory does not
shrink. So every `genrec-spec` command but `prepare` and `bench scale` (which hold catalogues
of up to 10^7 items in a machine's memory) calls it once at its start, as does a serving
process, while importing the library changes nothing: a program that decodes with genrec_spec
calls it itself. A bottom module like `genrec_spec.machine`: it imports nothing of the project.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

# mallopt's parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1  # free memory at the heap's top beyond this is given back to the kernel
M_MMAP_MAX = -4  # how many allocations may be mapped on their own (0: none, all from a heap)
M_ARENA_MAX = -8  # how many arenas threads allocate from (1: all share the main heap)
INT_MAX = 2**31 - 1  # mallopt takes an int: the largest trim threshold it can be given


@functools.cache
def keep_freed_memory() -> bool:
    """Make malloc keep freed memory for reuse, once per process (module docstring); whether it
    took effect (False where the C library has no `mallopt`: not glibc)."""
    path = ctypes.util.find_library("c")
    libc = ctypes.CDLL(path) if path else None
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return False
    # The arena first: an arena already given to a thread keeps serving it.
    settings = ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, INT_MAX))
    return all(mallopt(parameter, value) == 1 for parameter, value in settings)


def kept() -> bool:
    """Whether `keep_freed_memory` has taken effect in this process (benchmarks say so)."""
    return keep_freed_memory.cache_info().currsize > 0 and keep_freed_memory()
