"""The output folder of ``genrec-spec batch``: parquet shards plus a manifest of the completed
ones, kept exactly-once across kills and reruns.

Layout of OUT::

    _manifest.json          the job (arguments and hashes), the shard plan, the completed shards
    part-00000.parquet ...  one file per completed shard
    _lock                   held (flock) while a job writes; the kernel drops it when the job dies

Protocol: a shard is written under a hidden temporary name (``.part-00003.parquet.tmp-XXXX``)
and renamed into place only when complete; then the manifest is rewritten atomically (temporary
file + rename) to list it. A kill at any moment leaves each shard (a) without a file, (b) with a
complete file not yet listed, or (c) complete and listed. A rerun redoes every shard the manifest
does not list (the job's arguments are checked to be the same and shard assignment is
deterministic) after deleting leftover temporary and case-(b) files. A folder without any
completed shard holds nothing to protect and is started afresh, whatever its job. So a
finished job holds every requested user exactly once, and a reader never sees a partial shard:
pyarrow and pandas skip names starting with "." or "_", so ``pd.read_parquet(OUT)`` reads the
shards alone. Renames survive a killed process; surviving a power cut would also need fsyncs.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from genrec_spec.data_pipelines.atomic import replace_atomically
from genrec_spec.jobs.errors import BatchOutputError

MANIFEST = "_manifest.json"
LOCK = "_lock"
FORMAT_VERSION = 1


def shard_file(shard: int) -> str:
    return f"part-{shard:05d}.parquet"


class ShardStore:
    """An open, locked output folder; `write_shard` commits one shard, `finish` the job."""

    def __init__(self, out: Path, manifest: dict) -> None:
        self.out = out
        self.manifest = manifest

    @property
    def completed(self) -> set[int]:
        return set(self.manifest["completed"])

    @property
    def pending(self) -> list[int]:  # shards still to write, in order
        return [s for s in range(len(self.manifest["shard_users"])) if s not in self.completed]

    def write_shard(self, shard: int, table: pa.Table) -> None:
        """Write the complete rows of one shard, then record it in the manifest."""
        replace_atomically(self.out / shard_file(shard), lambda f: pq.write_table(table, f))
        self.manifest["completed"] = sorted(self.completed | {shard})
        self._save()

    def finish(self, summary: dict) -> None:
        """Mark the job complete (all shards written) and keep this run's summary."""
        self.manifest["complete"] = not self.pending
        self.manifest["runs"].append(summary)
        self._save()

    def _save(self) -> None:
        self.manifest["updated"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        data = (json.dumps(self.manifest, indent=1) + "\n").encode()
        replace_atomically(self.out / MANIFEST, lambda f: f.write(data))


@contextlib.contextmanager
def open_store(
    out: Path,
    job: dict,  # what determines the rows (hashes, k, decoder, ...): must match on resume
    shard_users: list[int],  # [shards] users per shard, the plan derived from `job`
    info: dict,  # paths and other context kept in the manifest but not compared
) -> Iterator[ShardStore]:
    """Create or resume the output folder `out` for `job` and hold its lock while in use."""
    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        lock = open(out / LOCK, "a")  # noqa: SIM115 -- held until the job ends
    except OSError as exc:
        raise BatchOutputError(
            f"cannot write the output folder {out}: {exc.strerror or exc}",
            "choose a writable --out folder",
        ) from exc
    try:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise BatchOutputError(
                f"another `genrec-spec batch` is writing to {out}",
                "wait for it to end or choose another --out",
            ) from None
        manifest = _resume_or_start(out, job, shard_users, info)
        listed = {shard_file(s) for s in manifest["completed"]}
        unlisted = [p for p in out.glob("part-*.parquet") if p.name not in listed]
        for leftover in [*out.glob(".*.tmp-*"), *unlisted]:  # files of a killed run
            leftover.unlink()
        store = ShardStore(out, manifest)
        store._save()
        yield store
    finally:
        lock.close()


def _resume_or_start(out: Path, job: dict, shard_users: list[int], info: dict) -> dict:
    """The manifest to go on with: the folder's own if it holds the same job, a new one if it
    holds no completed shard yet (e.g. the last run failed on its first batch), else refused."""
    path = out / MANIFEST
    fresh = {
        "format": FORMAT_VERSION,
        "job": job,
        "shard_users": shard_users,
        "completed": [],
        "complete": False,
        "info": info,
        "runs": [],
    }
    if not path.is_file():
        foreign = [p.name for p in out.iterdir() if not (p.name == LOCK or p.name[0] == ".")]
        if foreign:
            raise BatchOutputError(
                f"output folder {out} is not empty and holds no batch job ({MANIFEST} is "
                f"missing; it has {', '.join(sorted(foreign)[:5])})",
                "choose a new or empty --out",
            )
        return fresh
    try:
        manifest = json.loads(path.read_text())
        old_job, completed = manifest["job"], manifest["completed"]
    except (ValueError, KeyError, TypeError) as exc:
        raise BatchOutputError(
            f"{path} is not a batch manifest ({exc})", "choose a new --out"
        ) from None
    if not completed:
        return fresh
    changed = [
        f"{key}: {old_job.get(key)!r} there, {job[key]!r} now"
        for key in job
        if old_job.get(key) != job[key]
    ]
    if changed or manifest.get("format") != FORMAT_VERSION:
        raise BatchOutputError(
            f"output folder {out} holds a batch job with other arguments ("
            + "; ".join(changed or [f"format {manifest.get('format')}"])
            + ")",
            "rerun with the arguments it was started with, or choose another --out",
        )
    manifest["info"] = info
    return manifest
