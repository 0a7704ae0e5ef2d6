"""A synthetic catalogue of any size, for measuring cost against catalogue size:
``genrec-spec prepare --dataset synthetic:N`` (``load_dataset("synthetic:N")``).

Items: N item embeddings of dimension 384 (the text encoder's), drawn from a two-level clustered
distribution of low intrinsic dimension, as real item embeddings are (genres, then sub-genres,
in a few dozen effective directions): ~N^(1/3) topics, ~N^(2/3) groups, each group under one
topic and ~N^(1/3) items in each group. In a ``latent_dim`` space an item is its topic's centre
plus its group's (weight ``group_weight``) plus its own direction (weight ``noise``), all unit
vectors; a fixed orthonormal map takes it to 384 dimensions, where a little isotropic noise
(``ambient``) is added and the vector L2-normalised. Item i's group is i mod groups and group
g's topic g mod topics, so every cluster is spread over the whole index. Residual k-means then
finds structure at every level (topics, groups, items within a group) and few items need the
collision code, as with real text embeddings; isotropic noise in all 384 dimensions instead
collapses the last level's codes (docs/results/scale.md has both measured).

Interactions: users who browse. A user starts at a random item and steps to the next items of
its group (rank + 1 most of the time, + 2 or + 3 otherwise); with probability ``jump`` a step
leaves for a random item, half the time one of the same topic: sequential structure a next-item
model can learn (the next item is one of a few given the last), as the tiny test data's +1
walks. About ``interactions_per_item`` interactions per item, ``mean_length`` per user, so users
grow with N. Items nobody touched stay in the catalogue (cold items).

Everything is drawn in chunks from generators seeded by (seed, what, chunk index), so any chunk
can be drawn alone and equals its slice of the whole; the same seed and chunk size give the same
data. The embeddings are handed to `prepare` as such a stream (`SyntheticEmbeddings`), which
writes them to disk a chunk at a time: a catalogue's embeddings can be larger than memory.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pandas as pd

from genrec_spec.data_pipelines.errors import DataError

SPEC_PREFIX = "synthetic:"


@dataclass(frozen=True)
class SyntheticConfig:
    dim: int = 384  # embedding width, the text encoder's
    latent_dim: int = 32  # the directions items vary in
    group_weight: float = 0.6  # a group's centre, relative to its topic's
    noise: float = 0.8  # an item's own direction, relative to its topic's centre
    ambient: float = 0.02  # isotropic noise per embedding dimension
    interactions_per_item: float = 2.0
    mean_length: int = 20  # interactions per user (each user has 10..30)
    jump: float = 0.1  # chance a step leaves the group (half of the jumps stay in the topic)
    seed: int = 0
    chunk: int = 1 << 16  # items (or users) drawn per generator call
    time_step: int = 60  # seconds between a user's interactions

    def clusters(self, items: int) -> tuple[int, int]:  # (topics, groups)
        topics = max(1, round(items ** (1 / 3)))
        return topics, max(topics, min(items, round(items ** (2 / 3))))


def parse_size(spec: str) -> int:
    """'synthetic:N' -> N (digits, or 1e6 style)."""
    text = spec.removeprefix(SPEC_PREFIX)
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if value != int(value) or value < 2:
        raise DataError(
            f"dataset spec {spec!r} does not give a catalogue size",
            "write synthetic:N with N >= 2 items, e.g. synthetic:100000 or synthetic:1e6",
        )
    return int(value)


def _rng(config: SyntheticConfig, what: int, chunk: int) -> np.random.Generator:
    return np.random.default_rng([config.seed, what, chunk])


def _directions(rng: np.random.Generator, rows: int, dim: int) -> np.ndarray:  # unit rows
    x = rng.standard_normal((rows, dim), dtype=np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def centres(items: int, config: SyntheticConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Topic centres [T, k] and group centres [G, k] (unit, latent), and the map [k, dim] to the
    embedding space (orthonormal rows)."""
    topics, groups = config.clusters(items)
    k = config.latent_dim
    gaussian = _rng(config, 0, 2).standard_normal((config.dim, k))
    projection = np.linalg.qr(gaussian)[0].T.astype(np.float32)
    return (
        _directions(_rng(config, 0, 0), topics, k),
        _directions(_rng(config, 0, 1), groups, k),
        projection,
    )


def embedding_chunk(
    start: int, stop: int, centres: tuple[np.ndarray, ...], config: SyntheticConfig
) -> np.ndarray:  # [stop - start, dim] float32, L2-normalised: items start..stop-1
    """The embeddings of items start..stop-1 (start a multiple of config.chunk, stop - start at
    most config.chunk: one generator call per chunk)."""
    topic, group, projection = centres
    rng = _rng(config, 1, start // config.chunk)
    g = np.arange(start, stop) % len(group)
    own = _directions(rng, stop - start, config.latent_dim)
    z = topic[g % len(topic)] + config.group_weight * group[g] + config.noise * own
    x = z @ projection + config.ambient * rng.standard_normal(
        (stop - start, config.dim), np.float32
    )
    return x / np.linalg.norm(x, axis=1, keepdims=True)


@dataclass(frozen=True)
class SyntheticEmbeddings:
    """The item embeddings [N, dim] float32 of a catalogue of N items, drawn a chunk at a time
    as they are read (`chunks`): never whole in memory. `prepare` writes them to disk so."""

    items: int
    config: SyntheticConfig

    @property
    def shape(self) -> tuple[int, int]:  # (N, dim)
        return self.items, self.config.dim

    def chunks(self) -> Iterator[np.ndarray]:  # [<= config.chunk, dim] float32 each, in order
        both = centres(self.items, self.config)
        for start in range(0, self.items, self.config.chunk):
            stop = min(self.items, start + self.config.chunk)
            yield embedding_chunk(start, stop, both, self.config)


def embeddings(items: int, config: SyntheticConfig) -> np.ndarray:  # [N, dim] float32
    """All of `SyntheticEmbeddings(items, config)` in memory."""
    out = np.empty((items, config.dim), dtype=np.float32)
    start = 0
    for chunk in SyntheticEmbeddings(items, config).chunks():
        out[start : start + len(chunk)] = chunk
        start += len(chunk)
    return out


def _members(cluster: np.ndarray, clusters: int, total: int) -> np.ndarray:
    """How many of 0..total-1 are congruent to each `cluster` modulo `clusters`."""
    return (total - cluster + clusters - 1) // clusters


def interaction_chunk(
    items: int, first_user: int, users: int, config: SyntheticConfig
) -> pd.DataFrame:  # user_id, item_id, timestamp, rating of `users` users
    rng = _rng(config, 2, first_user // config.chunk)
    topics, groups = config.clusters(items)
    lengths = rng.integers(config.mean_length // 2, config.mean_length * 3 // 2 + 1, users)
    steps = int(lengths.sum())
    user = np.repeat(np.arange(users), lengths)  # within the chunk
    first = np.concatenate([[True], user[1:] != user[:-1]])  # a user's first interaction
    jump = first | (rng.random(steps) < config.jump)
    # Landings: a random item; half the later jumps a random item of the user's home topic
    # (the first item's): a random group of it, then a random item of that group.
    landing = rng.integers(0, items, steps)
    home = (landing[first] % groups % topics)[user]  # [steps]
    stay = jump & ~first & (rng.random(steps) < 0.5)
    group = home + topics * (rng.random(steps) * _members(home, topics, groups)).astype(np.int64)
    member = (rng.random(steps) * _members(group, groups, items)).astype(np.int64)
    landing = np.where(stay, group + groups * member, landing)
    # Walk: the last landing, advanced within its group by the rank steps since then.
    advance = rng.choice([1, 2, 3], steps, p=[0.8, 0.15, 0.05])
    segment = np.cumsum(jump) - 1
    start_item = landing[jump][segment]
    moved = np.cumsum(np.where(jump, 0, advance))
    moved -= moved[jump][segment]
    group = start_item % groups
    item = group + ((start_item // groups + moved) % _members(group, groups, items)) * groups
    order = np.arange(steps) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    return pd.DataFrame(
        {
            "user_id": np.char.add("u", (user + first_user).astype(str)).astype(object),
            "item_id": np.char.add("s", item.astype(str)).astype(object),
            "timestamp": (order * config.time_step).astype(np.int64),
            "rating": np.ones(steps, dtype=np.float32),
        }
    )


def users_for(items: int, config: SyntheticConfig) -> int:
    return max(2, round(items * config.interactions_per_item / config.mean_length))


def interactions(items: int, config: SyntheticConfig) -> pd.DataFrame:
    total = users_for(items, config)
    parts = [
        interaction_chunk(items, first, min(config.chunk, total - first), config)
        for first in range(0, total, config.chunk)
    ]
    return pd.concat(parts, ignore_index=True)


def item_table(items: int) -> pd.DataFrame:
    """item_id and text of every item (the catalogue, cold items included)."""
    ids = np.char.add("s", np.arange(items).astype(str)).astype(object)
    return pd.DataFrame({"item_id": ids, "text": "Item: " + pd.Series(ids) + "."})


# What the streamed `prepare` of a synthetic catalogue holds at its peak: per item (its codes,
# Semantic and long IDs as int64, the item table and index, the sorts of the collision codes),
# per interaction row (the interaction table, the split, their parquet writes) and a fixed part
# (the k-means samples, a batch of rows, a slice of items.parquet). Measured peaks, with a
# margin, are in docs/results/scale.md.
PEAK_BYTES_PER_ITEM = 500
PEAK_BYTES_PER_ROW = 250
PEAK_FIXED_BYTES = 1 << 30


def memory_needed(items: int, config: SyntheticConfig) -> int:
    """Bytes `prepare` holds at its peak for N synthetic items. The embeddings are not among
    them: they are written to disk a chunk at a time and read back a batch at a time."""
    rows = users_for(items, config) * config.mean_length
    return PEAK_BYTES_PER_ITEM * items + PEAK_BYTES_PER_ROW * rows + PEAK_FIXED_BYTES


def available_memory() -> int:
    """MemAvailable of /proc/meminfo in bytes (what can be allocated without swapping)."""
    with open("/proc/meminfo") as info:
        for line in info:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise DataError("/proc/meminfo has no MemAvailable", "run on Linux")


def synthetic_parts(spec: str, config: SyntheticConfig = SyntheticConfig()) -> dict:
    """The fields of `load_dataset("synthetic:N")`'s RawDataset: name, interactions, items,
    missing_metadata, embeddings. Refuses, before any work, a size whose peak would not fit in
    the memory available now."""
    items = parse_size(spec)
    needed, free = memory_needed(items, config), available_memory()
    if needed > free:
        most = items
        while most > 2 and memory_needed(most, config) > free:
            most //= 2
        raise DataError(
            f"synthetic:{items} needs about {needed / 2**30:.1f} GiB at its peak; "
            f"{free / 2**30:.1f} GiB are available",
            f"use at most synthetic:{most} here, or a machine with more memory",
        )
    return {
        "name": f"synthetic-{items}",
        "interactions": interactions(items, config),
        "items": item_table(items),
        "missing_metadata": 0,
        "embeddings": SyntheticEmbeddings(items, config),
    }
