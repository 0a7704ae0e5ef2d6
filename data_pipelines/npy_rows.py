"""A matrix kept on disk as a .npy file, written and read a batch of rows at a time.

A catalogue's item embeddings can be larger than memory: they are written chunk by chunk
(`NpyRowWriter`) and read back in row batches (`NpyRows`), never whole. The file is an ordinary
.npy: `np.load` reads it, `np.load(path, mmap_mode="r")` maps it. Its header is `np.save`'s, so a
matrix written in one batch has `np.save`'s bytes.

Rows are read with plain file reads, not through a memory map: the pages a mapping touches count
in the process's resident memory until the kernel evicts them, so a pass over a mapped matrix
larger than memory would look (and be measured) as if it held all of it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np

from genrec_spec.data_pipelines.errors import DataError


class NpyRowWriter:
    """Writes an [N, E] matrix to a .npy file in row batches, in order; `close` checks that N
    rows came. Use as a context manager."""

    def __init__(self, path: Path, shape: tuple[int, int], dtype=np.float32) -> None:
        self.path, self.shape, self.dtype = Path(path), tuple(shape), np.dtype(dtype)
        self.rows = 0
        self._file = open(self.path, "wb")
        header = {"descr": np.lib.format.dtype_to_descr(self.dtype), "fortran_order": False}
        np.lib.format.write_array_header_1_0(self._file, header | {"shape": self.shape})

    def write(self, rows: np.ndarray) -> None:  # rows: [b, E], the next b rows
        if (
            rows.ndim != 2
            or rows.shape[1] != self.shape[1]
            or self.rows + len(rows) > self.shape[0]
        ):
            raise DataError(
                f"rows of shape {rows.shape} do not continue a {self.shape} matrix "
                f"after {self.rows} rows",
                "write [rows, E] batches in order, N rows in all",
            )
        self._file.write(np.ascontiguousarray(rows, dtype=self.dtype).data)
        self.rows += len(rows)

    def close(self) -> None:
        self._file.close()
        if self.rows != self.shape[0]:
            raise DataError(
                f"{self.path} got {self.rows} of its {self.shape[0]} rows",
                "write every row before closing",
            )

    def __enter__(self) -> NpyRowWriter:
        return self

    def __exit__(self, kind, error, trace) -> None:
        if kind is None:
            self.close()
        else:
            self._file.close()  # the caller removes the partial file


class NpyRows:
    """An [N, E] .npy matrix on disk, read by row ranges: `rows[start:stop]` is an in-memory
    [stop - start, E] array (the only indexing it offers), `len(rows)` is N."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        mapped = np.load(self.path, mmap_mode="r")  # reads the header; touches no rows
        if mapped.ndim != 2 or not mapped.flags.c_contiguous:
            raise DataError(
                f"{self.path} holds a {mapped.shape} array, not a C-order matrix",
                "pass a C-order [rows, columns] .npy matrix",
            )
        self.shape, self.dtype, self.offset = mapped.shape, mapped.dtype, mapped.offset
        del mapped

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, rows: slice) -> np.ndarray:  # [stop - start, E]
        if not isinstance(rows, slice) or rows.step not in (None, 1):
            raise TypeError("NpyRows reads contiguous row ranges only: rows[start:stop]")
        start, stop, _ = rows.indices(self.shape[0])
        count = max(0, stop - start) * self.shape[1]
        with open(self.path, "rb") as f:
            f.seek(self.offset + start * self.shape[1] * self.dtype.itemsize)
            out = np.fromfile(f, dtype=self.dtype, count=count)
        return out.reshape(-1, self.shape[1])


def row_batches(x, batch: int) -> Iterator[tuple[int, np.ndarray]]:
    """(start, x[start:start + batch] as float32) over the rows of x: an [N, E] array, tensor
    converted by the caller, or `NpyRows`."""
    for start in range(0, len(x), batch):
        yield start, np.ascontiguousarray(x[start : start + batch], dtype=np.float32)
