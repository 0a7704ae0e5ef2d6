"""The synthetic catalogues `bench scale` measures: prepared once per size, with what preparing
cost (wall time and the peak resident memory of the `prepare` process), kept beside the folder.

    cost = prepared_catalogue(1_000_000, Path("/tmp/scale"), levels=3, log=print)

`genrec-spec prepare --dataset synthetic:N` runs in a child process, so its peak memory is its
own (`ru_maxrss` of that child, from `os.wait4`) and not the benchmark's. The cost is written to
`<root>/synthetic-N.prepare-cost.json` (beside the folder, whose file hashes it must not
change); a later run reuses the folder and that record. A folder prepared by hand (no record)
is reused with the manifest's step timings and no peak memory.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from genrec_spec.bench.errors import BenchError
from genrec_spec.data_pipelines.atomic import atomic_write_bytes


@dataclass(frozen=True)
class PrepareCost:
    """What preparing one synthetic catalogue cost."""

    items: int
    folder: str
    wall_s: float  # the prepare process's wall time (or the manifest's steps summed)
    peak_rss_bytes: int | None  # its peak resident memory; None: not measured (reused folder)
    command: str  # how it was prepared
    measured: bool  # True: timed here; False: read from a folder prepared before


def folder_of(root: Path, items: int, levels: int | None, options: tuple[str, ...] = ()) -> Path:
    """Where the catalogue of `items` items (these levels, these other prepare options) lives
    under `root`."""
    name = f"synthetic-{items}" + (f"-L{levels}" if levels else "")
    if options:
        name += "-" + hashlib.sha256(" ".join(options).encode()).hexdigest()[:8]
    return root / name


# prepare's arguments that bench scale sets itself: a catalogue's size, folder and levels
OWN_OPTIONS = ("--dataset", "--out", "--levels", "--overwrite", "--help")


def check_prepare_options(options: tuple[str, ...]) -> None:
    """Refuse prepare options that would override what bench scale sets itself (argparse takes
    the last of a flag given twice, and any unambiguous prefix of a flag's name): the catalogue
    measured would not be the one the report names."""
    for option in options:
        name = option.split("=", 1)[0]
        if option == "-h" or (
            name.startswith("--") and len(name) > 2 and any(o.startswith(name) for o in OWN_OPTIONS)
        ):
            raise BenchError(
                f"--prepare-options holds {option}, which bench scale sets itself",
                "leave out --dataset, --out, --levels, --overwrite and --help (use --sizes, "
                "--data-root and --levels of bench scale)",
            )


def prepare_command(
    items: int, out: Path, levels: int | None, options: tuple[str, ...] = ()
) -> list[str]:
    command = ["prepare", "--dataset", f"synthetic:{items}", "--out", str(out), "--no-progress"]
    return command + (["--levels", str(levels)] if levels else []) + list(options)


def prepared_catalogue(
    items: int,
    root: Path,
    levels: int | None = None,  # prepare's --levels; None: its choice by catalogue size
    log: Callable[[str], None] = lambda line: None,
    options: tuple[str, ...] = (),  # other arguments of `genrec-spec prepare`
) -> PrepareCost:
    """The catalogue's folder under `root`, prepared now (timed) unless already there."""
    out = folder_of(root, items, levels, options)
    record = out.with_name(out.name + ".prepare-cost.json")
    command = prepare_command(items, out, levels, options)
    if (out / "manifest.json").exists():
        if record.exists():  # the folder where it is now: catalogues can be moved or copied
            recorded = json.loads(record.read_text()) | {"folder": str(out), "measured": False}
            return PrepareCost(**recorded)
        manifest = json.loads((out / "manifest.json").read_text())
        wall = sum(manifest.get("timings_s", {}).values())
        log(f"{out}: prepared before, no cost record; the manifest's steps sum to {wall:.1f} s")
        return PrepareCost(items, str(out), wall, None, "genrec-spec " + " ".join(command), False)
    root.mkdir(parents=True, exist_ok=True)
    log(f"preparing synthetic:{items} into {out} ...")
    start = time.perf_counter()
    child = subprocess.Popen(
        [sys.executable, "-m", "genrec_spec.cli", *command],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    output = child.stdout.read()  # until the child closes it (it exits)
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - start
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode:
        raise BenchError(
            f"genrec-spec {' '.join(command)} failed (exit {child.returncode}):\n{output[-2000:]}",
            "run that command by hand to see the error, or give --data-root a prepared folder",
        )
    cost = PrepareCost(
        items=items,
        folder=str(out),
        wall_s=wall,
        peak_rss_bytes=usage.ru_maxrss * 1024,  # Linux reports KiB
        command="genrec-spec " + " ".join(command),
        measured=True,
    )
    fields = asdict(cost)
    del fields["measured"]
    atomic_write_bytes(record, (json.dumps(fields, indent=1) + "\n").encode())
    log(f"prepared in {wall:.1f} s, peak {cost.peak_rss_bytes / 2**30:.2f} GiB")
    return cost
