"""Write outputs so that a reader never sees a half-written file or folder.

Everything is written under a temporary sibling name and renamed into place when complete: a
crash, a kill or a bad input leaves the destination as it was (absent, or the previous complete
version), never a partial result that looks finished. An exception removes the temporary folder;
a process killed outright cannot, so its folder (named after its host and process id) is removed
by the next `atomic_dir` of the same destination once that process is gone.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import socket
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from genrec_spec.data_pipelines.errors import DataError


@contextlib.contextmanager
def atomic_dir(dest: Path, *, overwrite: bool = False) -> Iterator[Path]:
    """Yield a fresh temporary folder beside `dest`; on success it replaces `dest`.

    `dest` existing and non-empty is refused unless `overwrite` (then the old folder is swapped
    out only after the new one is complete). On any exception the temporary folder is removed.
    """
    dest = Path(dest)
    check_output_dir(dest, overwrite=overwrite)
    parent = dest.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        _remove_abandoned(dest)
        prefix = f"{_temporary_prefix(dest)}{os.getpid()}-"
        tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    except OSError as exc:
        raise PermissionError(
            f"cannot create the output folder beside {dest}: {exc.strerror}. "
            "Fix: choose a writable --out location"
        ) from exc
    try:
        yield tmp
        old = None
        if dest.exists():
            old = parent / f".{dest.name}.old-{os.getpid()}"
            dest.rename(old)
        tmp.rename(dest)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _temporary_prefix(dest: Path) -> str:  # .<name>.tmp-<host>- (then <pid>-<random>)
    return f".{dest.name}.tmp-{socket.gethostname()}-"


def _remove_abandoned(dest: Path) -> None:
    """Remove the temporary folders of `dest` left by killed processes of this host."""
    prefix = _temporary_prefix(dest)
    for path in dest.parent.glob(f"{glob.escape(prefix)}*"):
        pid = path.name[len(prefix) :].split("-", 1)[0]
        if path.is_dir() and pid.isdigit() and not _running(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def check_output_dir(dest: Path, *, overwrite: bool = False) -> None:
    """Refuse an output folder we must not replace; jobs call this before their slow work."""
    dest = Path(dest)
    if dest.exists() and not dest.is_dir():
        raise NotADirectoryError(
            f"output path {dest} exists and is a file. Fix: pass a folder path for --out"
        )
    if dest.is_dir() and any(dest.iterdir()) and not overwrite:
        raise FileExistsError(
            f"output folder {dest} already exists and is not empty. "
            "Fix: choose another --out or pass --overwrite"
        )


def check_writable_folder(dest: Path, flag: str = "--out") -> None:
    """Refuse a folder that cannot be made or written to (a file, a path under one, a read-only
    or system place), naming the option that gave it: jobs that write at their end call this
    before their slow work. A folder it had to make is removed again (the job makes it when it
    writes)."""
    dest = Path(dest)
    if dest.exists() and not dest.is_dir():
        raise DataError(f"{flag} {dest} is a file", f"pass a folder path for {flag}")
    made = not dest.exists()
    try:
        dest.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=dest):
            pass
    except OSError as exc:
        raise DataError(
            f"cannot write to the folder {dest} ({flag}): {exc.strerror or exc}",
            f"pass a folder path you can write to for {flag}",
        ) from exc
    finally:
        if made and dest.is_dir():
            with contextlib.suppress(OSError):
                dest.rmdir()


def replace_atomically(dest: Path, write: Callable[[BinaryIO], object]) -> None:
    """Let `write` fill a hidden temporary file beside `dest`, then rename it to `dest`."""
    dest = Path(dest)
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.tmp-", dir=dest.parent)
    try:
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide the output from other readers
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, dest)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_bytes(dest: Path, data: bytes) -> None:
    """Write `data` to `dest` through a temporary file in the same folder and an atomic rename."""
    replace_atomically(dest, lambda f: f.write(data))


def json_made_once(
    dest: Path, make: Callable[[], dict], valid: Callable[[dict], bool] = lambda record: True
) -> dict:
    """The JSON record kept in `dest`, or else `make()`'s, written there (its folder created)
    for the next reader: a file that is absent, cannot be read or fails `valid` is made again
    and replaced. What timed measurements on a machine are kept in."""
    dest = Path(dest)
    try:
        record = json.loads(dest.read_text())
        if isinstance(record, dict) and valid(record):
            return record
    except (OSError, ValueError, KeyError, TypeError):
        pass  # absent or unreadable: make it again
    record = make()
    dest.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(dest, json.dumps(record, indent=1).encode())
    return record
