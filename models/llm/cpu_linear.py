"""x @ W^T on a CPU by the path this machine runs fastest, chosen by measuring it.

Three paths give the same product up to float rounding:

- ``linear``: ``F.linear`` (ATen and its BLAS), the safe default;
- ``weight_major``: ``(W @ x^T)^T``, a single row padded to two, the product in the BLAS's other
  orientation, which some CPUs stream near memory bandwidth at one or two rows;
- ``packed``: oneDNN's linear on a copy of W laid out for it once (``PACK_ROWS_HINT``), which
  costs as much memory again as W.

Which is fastest depends on the CPU (vector units, caches, the BLAS's kernels), the thread count,
the matrix's shape and the number of rows: a path tuned by hand on one machine ran at half
speed on another. So the first product of a shape at a row count (its bucket, `BUCKETS`) times
every path on random weights of that shape, copied until they outgrow the caches
(`STREAM_BYTES`, `MAX_COPIES`) as a layer stack does, and keeps the fastest. Choices are saved under
``$GENREC_SPEC_CACHE/cpu_linear/``, one file per machine key (the CPU model and flags, the
thread count, the torch build and `VERSION`): another CPU or thread count measures anew.
`measure_shapes` takes every bucket of a model's shapes at once (benchmarks do, before timing).

``GENREC_SPEC_CPU_LINEAR`` sets the mode, read on first use (``forget`` reads it again):
``measure`` (the default), ``off`` (always ``F.linear``, nothing measured) or a path's name (that
path always; the tests run the exactness suites under each). Products that need a gradient, or
are not fp32, always take ``F.linear``.
"""

from __future__ import annotations

import bisect
import functools
import json
import math
import os
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
import torch.nn.functional as F

from genrec_spec.cache import cache_dir
from genrec_spec.data_pipelines.atomic import atomic_write_bytes
from genrec_spec.machine import describe, machine_key, time_in_turns
from genrec_spec.models.derived import DerivedCache
from genrec_spec.models.llm.llama_config import LlamaError

PATHS = ("linear", "weight_major", "packed")
MODE_ENV = "GENREC_SPEC_CPU_LINEAR"
MODES = ("measure", "off", *PATHS)
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)  # rows timed; a product takes the next bucket up
STREAM_BYTES = 32 << 20  # weights per timed product: more than a CPU's caches hold
MAX_COPIES = 64  # of a small weight: a model with tinier matrices keeps them in cache anyway
PACK_ROWS_HINT = 8  # the row count oneDNN lays the packed weights out for
REPEATS = 7  # timed rounds per path (medians), after one round of warm-up
# Another path must beat F.linear by this share to be chosen. Timed alone, paths within a few
# percent are a tie, and a tie can go either way inside a model's pass, where the products
# share the caches with everything else: SmolLM2's gate and up products, oneDNN's by a hair
# alone, ran its one-row decoding steps slower than F.linear did (docs/results/llm.md).
MARGIN = 0.05
VERSION = 3  # part of the machine key: bump when a path's code, or the rule, changes a choice
_PACKED = DerivedCache()  # weight -> its oneDNN-packed copy
_CHOSEN: dict[tuple, str] = {}  # (threads, shape, rows) -> path, see `linear`


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
    """``F.linear(x, weight)`` (no bias) by this machine's fastest path for its shape and rows."""
    if not x.is_cpu or not _measurable(x, weight):
        return F.linear(x, weight)
    rows = x.numel() // x.shape[-1]
    # A decoding step makes hundreds of small products, so what picks a path must cost little
    # next to a one-row product: the choices (and the mode) are remembered per process.
    key = (torch.get_num_threads(), weight.shape, rows)
    path = _CHOSEN.get(key)
    if path is None:
        path = _CHOSEN[key] = choice(tuple(weight.shape), rows)
    if path == "linear":
        return F.linear(x, weight)
    flat = x.reshape(rows, x.shape[-1]).contiguous()  # [rows, in]
    return PRODUCTS[path](flat, weight).reshape(*x.shape[:-1], weight.shape[0])


def _measurable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    return not needs_grad and x.dtype == weight.dtype == torch.float32


def _weight_major(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # [rows, out]
    rows = x.shape[0]
    if rows == 1:
        x = F.pad(x, (0, 0, 0, 1))  # [2, in]: a one-column product would be a slow GEMV
    return (weight @ x.T).T[:rows].contiguous()


def _pointwise(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:  # [rows, out]
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def _pack(weight: torch.Tensor) -> torch.Tensor:  # [out, in] in oneDNN's layout
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS_HINT)


PRODUCTS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "linear": lambda x, weight: F.linear(x, weight),
    "weight_major": _weight_major,
    "packed": lambda x, weight: _pointwise(x, packed_weight(weight)),
}


def packed_weight(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's layout of `weight`, made once and again when the weight changes."""
    return _PACKED.get(weight, (weight,), lambda: _pack(weight))


@functools.cache
def mode() -> str:
    """The mode ``GENREC_SPEC_CPU_LINEAR`` sets (module docstring), read once per process."""
    value = os.environ.get(MODE_ENV) or "measure"
    if value not in MODES:
        raise LlamaError(
            f"{MODE_ENV}={value!r} is not a mode of the CPU linear",
            f"set it to one of {', '.join(MODES)}, or unset it",
        )
    return value


def available_paths() -> tuple[str, ...]:
    """The paths this torch build can run (``packed`` needs oneDNN)."""
    return PATHS if torch.backends.mkldnn.is_available() else PATHS[:2]


def bucket(rows: int) -> int:
    """The row count a product of `rows` rows is chosen by: the next of `BUCKETS` up."""
    return BUCKETS[min(bisect.bisect_left(BUCKETS, rows), len(BUCKETS) - 1)]


def choice(shape: tuple[int, int], rows: int) -> str:
    """The path a product of `rows` rows with a weight of `shape` (out, in) takes."""
    current = mode()
    if current == "off":
        return "linear"
    if current != "measure":
        return current
    return table(torch.get_num_threads()).choose(shape, bucket(rows))


def forget() -> None:
    """Drop this process's choices and mode, to read or measure them again (when the mode, the
    cache folder or the machine key changes under a running process, as in the tests)."""
    _CHOSEN.clear()
    mode.cache_clear()
    table.cache_clear()


@functools.cache
def table(threads: int) -> ChoiceTable:
    """This machine's choices at `threads` torch threads (one table per process and count)."""
    return ChoiceTable(cache_dir() / "cpu_linear" / f"{machine_key(threads, VERSION)}.json")


class ChoiceTable:
    """The fastest path per (shape, bucket) on this machine, measured once and kept in `file`."""

    def __init__(self, file: Path) -> None:
        self.file = file
        self.entries: dict[str, dict] = self._read()  # "OUTxIN@BUCKET" -> {path, microseconds}

    @staticmethod
    def key(shape: tuple[int, int], rows: int) -> str:
        return f"{shape[0]}x{shape[1]}@{rows}"

    def choose(self, shape: tuple[int, int], rows: int) -> str:
        entry = self.entries.get(self.key(shape, rows))
        if entry is None:
            entry = self.measure(shape, rows)
        return entry["path"]

    def measure(self, shape: tuple[int, int], rows: int) -> dict:
        times = time_paths(shape, rows)
        entry = {"path": fastest(times), "us": {p: t * 1e6 for p, t in times.items()}}
        self.entries = self._read() | {self.key(shape, rows): entry}  # keep other processes'
        self._write()
        return entry

    def _read(self) -> dict[str, dict]:
        try:
            entries = json.loads(self.file.read_text())["choices"]
            return {k: v for k, v in entries.items() if v.get("path") in available_paths()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return {}  # absent or unreadable: measure again

    def _write(self) -> None:
        self.file.parent.mkdir(parents=True, exist_ok=True)
        record = {"machine": describe(), "choices": self.entries}
        atomic_write_bytes(self.file, json.dumps(record, indent=1).encode())


def fastest(times: dict[str, float]) -> str:
    """The path to take given each path's time: the fastest, unless it beats ``linear`` (the safe
    default) by less than `MARGIN`."""
    best = min(times, key=times.get)
    return best if times[best] < (1 - MARGIN) * times["linear"] else "linear"


@torch.no_grad()
def time_paths(shape: tuple[int, int], rows: int) -> dict[str, float]:
    """Seconds per product of `rows` rows with a weight of `shape`, per available path: the
    median of `REPEATS` rounds over copies of a random weight that outgrow the caches, the paths
    taking turns so a slow spell of a shared machine lands on each alike."""
    generator = torch.Generator().manual_seed(0)
    copies = min(MAX_COPIES, max(1, math.ceil(STREAM_BYTES / (4 * shape[0] * shape[1]))))
    weights = [torch.randn(shape, generator=generator) for _ in range(copies)]
    x = torch.randn(rows, shape[1], generator=generator)
    paths = available_paths()
    operands = {path: weights for path in paths}
    products = dict(PRODUCTS)
    if "packed" in paths:  # packed once, as a model's weights are: not part of a product's time
        operands["packed"], products["packed"] = [_pack(w) for w in weights], _pointwise

    def product(path: str) -> None:  # every copy once
        for operand in operands[path]:
            products[path](x, operand)

    seconds = time_in_turns({path: functools.partial(product, path) for path in paths}, REPEATS)
    return {path: t / copies for path, t in seconds.items()}


def measure_shapes(shapes: Iterable[tuple[int, int]], buckets: Iterable[int] = BUCKETS) -> None:
    """Choose every bucket of every shape now (what `linear` would do on first use), so that a
    benchmark's timed runs do not measure; nothing to do unless the mode is ``measure``."""
    if mode() != "measure":
        return
    choices = table(torch.get_num_threads())
    for shape in dict.fromkeys(tuple(s) for s in shapes):
        for rows in buckets:
            choices.choose(shape, rows)


def summary(shapes: Iterable[tuple[int, int]]) -> list[str]:
    """The choices for `shapes`, one line per shape (benchmarks print them under the machine)."""
    current = mode()
    if current != "measure":
        return [f"cpu linear: {current} for every product ({MODE_ENV})"]
    choices = table(torch.get_num_threads())
    lines = []
    for shape in dict.fromkeys(tuple(s) for s in shapes):
        picks = [f"{rows}:{choices.choose(shape, rows)}" for rows in BUCKETS]
        lines.append(f"cpu linear {shape[0]}x{shape[1]}, rows:path  {' '.join(picks)}")
    return lines
