"""The unit of work of ``genrec-spec batch``: a chunk of users, decoded in one decoder call by
either engine, and the settings that decide the chunks.

Plan: the users, in the order given, are cut into ``shards`` contiguous near-equal slices
(fewer when there are fewer users), each slice into chunks of ``batch_size`` users. The plan
follows from the arguments alone, so a rerun redoes exactly the shards the manifest lacks. A
chunk is one decoder call in either engine (`run_local` here, `batch_ray.run_ray`), so both
engines decode the same batches and write the same rows.

Shape letters: B users of a chunk, M history items, K list length.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from genrec_spec.models.recsys.times import HistoryTimes
from genrec_spec.recsys.checkpoint import MANIFEST, WEIGHTS
from genrec_spec.recsys.data import Histories
from genrec_spec.recsys.decoders.registry import get_decoder
from genrec_spec.recsys.item_trie import item_trie
from genrec_spec.recsys.types import Recommendations

ENGINES = ("local", "ray")


@dataclass(frozen=True)
class BatchConfig:
    """Defaults of ``genrec-spec batch``."""

    k: int = 50  # items per user
    decoder: str = "beam"  # a name of recsys.decoders.registry.DECODERS
    shards: int = 16  # output files; also the unit of resumption
    batch_size: int = 64  # users per decoder call (a chunk)
    engine: str = "local"  # "local" (in this process) or "ray" (Ray Data actor pool)
    ray_address: str | None = None  # a running Ray cluster (HOST:PORT); None = start Ray here
    actors: int = 2  # Ray actors, each holding one model copy and using one CPU
    ray_cpus: int = 2  # CPUs of the Ray started here (ignored with ray_address)
    ray_timeout_s: float = 5.0  # how long a --ray-address may take to answer a connect
    # torch CPU threads per process; None: every core for the local engine (a batch uses them
    # all), one per Ray actor (the actors share the cores)
    threads: int | None = None
    progress: bool = True  # tqdm bar on stderr


@dataclass(frozen=True)
class Chunk:
    """The users of one decoder call: the `index`-th batch of shard `shard`."""

    shard: int
    index: int
    user_ids: list[str]  # [B]
    values: Tensor  # [M] int64 item indices, oldest first within a user
    offsets: Tensor  # [B+1] int64
    times: HistoryTimes | None = None  # their timestamps (a time-aware model reads them)


class ChunkDecoder:
    """A decoder bound to a model and the catalogue's trie: what an engine runs per chunk."""

    def __init__(self, model, decoder: str, k: int, options: dict) -> None:
        self.model, self.k, self.options = model, k, options
        self.decode = get_decoder(decoder)
        self.trie = item_trie(model)

    @torch.inference_mode()
    def __call__(
        self, values: Tensor, offsets: Tensor, times: HistoryTimes | None = None
    ) -> Recommendations:  # values [M], offsets [B+1]
        return self.decode(
            self.model, values, offsets, k=self.k, trie=self.trie, times=times, **self.options
        )


def run_local(
    decoder: ChunkDecoder, chunks: list[Chunk]
) -> Iterator[tuple[Chunk, Recommendations]]:
    """The local engine: every chunk in order, in this process."""
    for chunk in chunks:
        yield chunk, decoder(chunk.values, chunk.offsets, chunk.times)


def model_hash(ckpt: Path) -> str:
    """sha256 (16 hex digits) of a checkpoint's manifest and weights: the model's identity."""
    digest = hashlib.sha256()
    for name in (MANIFEST, WEIGHTS):
        digest.update((Path(ckpt) / name).read_bytes())
    return digest.hexdigest()[:16]


def plan_shards(
    histories: Histories, shards: int, batch_size: int
) -> tuple[list[int], dict[int, list[Chunk]]]:
    """([shards] users per shard, shard -> its chunks): contiguous slices of the user order."""
    count = min(shards, len(histories))
    bounds = [s * len(histories) // count for s in range(count + 1)]
    chunks = {}
    for shard in range(count):
        rows = torch.arange(bounds[shard], bounds[shard + 1]).split(batch_size)
        parts = [histories.select(r) for r in rows]
        chunks[shard] = [
            Chunk(shard, i, part.user_ids, part.values, part.offsets, part.history_times())
            for i, part in enumerate(parts)
        ]
    return [bounds[s + 1] - bounds[s] for s in range(count)], chunks
