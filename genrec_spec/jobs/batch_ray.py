"""The Ray Data engine of ``genrec-spec batch``: the same chunks as the local engine, decoded by
a pool of actors, locally (``ray.init(num_cpus=...)``) or on a cluster at ``--ray-address``.

The dataset holds one row per chunk (shard, chunk index, the users' histories as item indices);
``map_batches`` hands one row at a time (``batch_size=1``) to ``RayChunkDecoder``, a callable
class that loads the checkpoint once in ``__init__``; a pool of ``actors`` actors, one CPU each.
A chunk is the unit, not a single user, so every decoder call sees exactly the users the local
engine would batch together and the rows come out identical. Results stream back to the driver,
which writes the shards (`batch.write_results`): one writer keeps exactly-once simple and the
output folder need not be visible to the workers. The checkpoint folder must be, at the same
path on every node; an actor checks the model hash it loads against the driver's.

A cluster address that does not answer, or where something other than Ray listens, is one clear
error before anything is written: ``ray.init(address=...)`` retries for minutes on either
(more than two against a port that accepts and closes). So the address is first probed within
``ray_timeout_s``: it must accept a connection and answer the HTTP/2 connection preface with a
SETTINGS frame, as Ray's GCS and Ray Client servers (both gRPC) do. A server that closes the
connection, sends anything else or stays silent is refused.
"""

from __future__ import annotations

import json
import logging
import socket
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from genrec_spec.jobs.batch_chunks import BatchConfig, Chunk, ChunkDecoder, model_hash
from genrec_spec.jobs.errors import BatchInputError, RayAddressError
from genrec_spec.memory import keep_freed_memory
from genrec_spec.models.recsys.times import HistoryTimes
from genrec_spec.recsys.checkpoint import load_checkpoint
from genrec_spec.recsys.types import Recommendations, RecommendStats

# What an HTTP/2 client sends first: the connection preface, then a SETTINGS frame (9-byte
# header: length 0, type 4, no flags, stream 0).
HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])


def check_ray_address(address: str | None, timeout_s: float) -> None:
    """Raise unless `address` is None, "auto" or HOST:PORT (ray:// too) where a gRPC server, as
    Ray's are, answers (module docstring)."""
    if address is None or address == "auto":  # Ray then starts here / finds its own cluster
        return
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not host or not port.isdigit():
        raise RayAddressError(
            f"--ray-address {address!r} is not HOST:PORT",
            "pass the head's GCS address HOST:PORT (e.g. 10.0.0.5:6379) or ray://HOST:10001",
        )
    try:
        conn = socket.create_connection((host, int(port)), timeout=timeout_s)
    except OSError as exc:  # refused, unreachable or timed out
        raise RayAddressError(
            f"no Ray cluster answers at {address} ({exc})",
            "start one there with `ray start --head`, or leave out --ray-address to run Ray on "
            "this machine",
        ) from None
    with conn:
        try:
            conn.sendall(HTTP2_PREFACE)
            with conn.makefile("rb") as reply:
                header = reply.read(9)  # the server's first frame header
            answer = f"it answered {header!r}" if len(header) == 9 else "it closed the connection"
        except OSError as exc:  # reset, or silent until the timeout
            header, answer = b"", str(exc)
    length, kind, flags, stream = int.from_bytes(header[:3]), header[3:4], header[4:5], header[5:]
    if len(header) < 9 or kind != b"\x04" or flags != b"\x00" or any(stream) or length % 6:
        raise RayAddressError(
            f"--ray-address {address} accepts connections but is not a Ray cluster (Ray's gRPC "
            f"servers answer with an HTTP/2 SETTINGS frame; here: {answer})",
            "pass the head node's GCS address (port 6379 unless `ray start --port` chose "
            "another) or ray://HOST:10001",
        )


class RayChunkDecoder:
    """The actor: one model copy, decoding one chunk row per call."""

    def __init__(
        self, ckpt: str, expected_hash: str, decoder: str, k: int, options: dict, threads: int
    ) -> None:
        torch.set_num_threads(threads)
        keep_freed_memory()  # a worker process decodes batch after batch, as the local job's
        if model_hash(Path(ckpt)) != expected_hash:
            raise BatchInputError(
                f"the checkpoint at {ckpt} on this Ray node is not the driver's (hash "
                f"{expected_hash})",
                "make the same checkpoint folder visible on every node",
            )
        model, _ = load_checkpoint(ckpt)
        self.decode = ChunkDecoder(model, decoder, k, options)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        values, offsets = (
            torch.as_tensor(np.asarray(batch[name][0], dtype=np.int64))
            for name in ("values", "offsets")
        )  # [M], [B+1]
        times = None
        if "times" in batch:  # [B + M]: the query times, then the items'
            both = torch.as_tensor(np.asarray(batch["times"][0], dtype=np.int64))
            times = HistoryTimes(both[len(offsets) - 1 :], both[: len(offsets) - 1])
        out = self.decode(values, offsets, times)
        return {
            "shard": batch["shard"],
            "index": batch["index"],
            "items": out.items.numpy()[None],  # [1, B, K]
            "scores": out.scores.numpy()[None],  # [1, B, K]
            "stats": np.array([json.dumps(out.stats.as_dict())]),
        }


def run_ray(
    ckpt: Path, expected_hash: str, chunks: list[Chunk], config: BatchConfig, options: dict
) -> Iterator[tuple[Chunk, Recommendations]]:
    """Decode `chunks` on a Ray actor pool; yields results as they arrive, in any order."""
    if not chunks:
        return
    import ray
    import ray.data  # configures the "ray.data" logger, so import before quieting it

    address = config.ray_address
    try:
        ray.init(
            # "local": a Ray of its own here, even where `ray start` left a cluster running
            # (which address=None would join).
            address=address or "local",
            num_cpus=None if address else config.ray_cpus,
            log_to_driver=False,
            include_dashboard=False,
            logging_level="error",
        )
    except ConnectionError as exc:
        raise RayAddressError(
            f"cannot join the Ray cluster at {address}: {exc}",
            "check that the cluster runs the same Ray version, or leave out --ray-address",
        ) from None
    data_logger = logging.getLogger("ray.data")
    level = data_logger.level
    try:
        data_logger.setLevel(logging.ERROR)  # no per-dataset notices between the bar's updates
        context = ray.data.DataContext.get_current()
        context.enable_progress_bars = False  # the job's own bar counts users
        context.print_on_execution_start = False
        rows = [
            {
                "shard": c.shard,
                "index": c.index,
                "values": c.values.tolist(),
                "offsets": c.offsets.tolist(),
                # One list that is never empty (a column of empty lists does not reach the
                # actors): the query times, then the items'
                **(
                    {}
                    if c.times is None
                    else {"times": c.times.query.tolist() + c.times.values.tolist()}
                ),
            }
            for c in chunks
        ]
        results = ray.data.from_items(rows).map_batches(
            RayChunkDecoder,
            fn_constructor_kwargs={
                "ckpt": str(Path(ckpt).resolve()),
                "expected_hash": expected_hash,
                "decoder": config.decoder,
                "k": config.k,
                "options": options,
                "threads": config.threads or 1,  # the actors share the cores
            },
            batch_size=1,
            batch_format="numpy",
            compute=ray.data.ActorPoolStrategy(size=config.actors),
            num_cpus=1,
        )
        by_key = {(c.shard, c.index): c for c in chunks}
        for row in results.iter_rows():
            out = Recommendations(
                items=torch.tensor(row["items"]),  # [B, K]
                scores=torch.tensor(row["scores"]),  # [B, K]
                stats=RecommendStats(**json.loads(row["stats"])),
            )
            yield by_key[int(row["shard"]), int(row["index"])], out
    finally:
        data_logger.setLevel(level)
        ray.shutdown()
