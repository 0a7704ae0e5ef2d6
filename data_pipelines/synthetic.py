"""A synthetic catalogue of any size, for measuring cost against catalogue size:
``genrec-spec prepare --dataset synthetic:N`` (``load_dataset("synthetic:N")``).

Items: N item embeddings of dimension 384 (the text encoder's), drawn from a clustered
distribution as real item embeddings are: ``topics`` unit centres, each item its topic's centre
plus isotropic noise, L2-normalised (cosine to its own centre ~0.7, to another ~0). Item i's
topic is i mod topics, and its rank inside the topic i // topics, so the items of a topic are
spread over the whole index.

Interactions: users who browse. A user starts at a random item and steps to the next items of
the same topic (rank + 1 most of the time, + 2 or + 3 otherwise), and with probability
``jump`` moves to a random item of another topic: sequential structure a next-item model can
learn (the next item is one of a few given the last), as the tiny test data's +1 walks. About
``interactions_per_item`` interactions per item, ``mean_length`` per user, so users grow with N.

Everything is drawn in chunks from generators seeded by (seed, what, chunk index), so any chunk
can be drawn alone (to stream a catalogue larger than memory) and equals its slice of the whole;
the same seed and chunk size give the same data.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from genrec_spec.data_pipelines.errors import DataError

SPEC_PREFIX = "synthetic:"


@dataclass(frozen=True)
class SyntheticConfig:
    dim: int = 384  # embedding width, the text encoder's
    topics_per_sqrt_item: float = 1.0  # topics = this * sqrt(N): ~100 at 10^4, ~3,000 at 10^7
    noise: float = 0.05  # per-dimension noise around a topic centre (cosine to it ~0.7)
    interactions_per_item: float = 2.0
    mean_length: int = 20  # interactions per user (each user has 10..30)
    jump: float = 0.1  # chance a step leaves the topic for a random item
    seed: int = 0
    chunk: int = 1 << 16  # items (or users) drawn per generator call
    time_step: int = 60  # seconds between a user's interactions

    def topics(self, items: int) -> int:
        return max(1, min(items, round(self.topics_per_sqrt_item * items**0.5)))


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


def topic_centres(items: int, config: SyntheticConfig) -> np.ndarray:  # [T, dim] float32
    centres = _rng(config, 0, 0).standard_normal((config.topics(items), config.dim))
    return (centres / np.linalg.norm(centres, axis=1, keepdims=True)).astype(np.float32)


def embedding_chunk(
    items: int, start: int, stop: int, centres: np.ndarray, config: SyntheticConfig
) -> np.ndarray:  # [stop - start, dim] float32, L2-normalised: items start..stop-1
    """The embeddings of items start..stop-1 (stop - start <= config.chunk, start a multiple of
    it: one generator call per chunk)."""
    noise = _rng(config, 1, start // config.chunk).standard_normal((stop - start, config.dim))
    x = centres[np.arange(start, stop) % len(centres)] + config.noise * noise.astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def embeddings(items: int, config: SyntheticConfig) -> np.ndarray:  # [N, dim] float32
    centres = topic_centres(items, config)
    out = np.empty((items, config.dim), dtype=np.float32)
    for start in range(0, items, config.chunk):
        stop = min(items, start + config.chunk)
        out[start:stop] = embedding_chunk(items, start, stop, centres, config)
    return out


def interaction_chunk(
    items: int, first_user: int, users: int, config: SyntheticConfig
) -> pd.DataFrame:  # user_id, item_id, timestamp, rating of `users` users
    rng = _rng(config, 2, first_user // config.chunk)
    topics = config.topics(items)
    lengths = rng.integers(config.mean_length // 2, config.mean_length * 3 // 2 + 1, users)
    steps = int(lengths.sum())
    user = np.repeat(np.arange(first_user, first_user + users), lengths)
    first = np.concatenate([[True], user[1:] != user[:-1]])  # a user's first interaction
    jump = first | (rng.random(steps) < config.jump)
    landing = rng.integers(0, items, steps)  # where a jump lands
    advance = rng.choice([1, 2, 3], steps, p=[0.8, 0.15, 0.05])  # in-topic rank steps
    # Walk: item = the last landing, advanced within its topic by the steps since then.
    segment = np.cumsum(jump) - 1
    start_item = landing[jump][segment]
    moved = np.cumsum(np.where(jump, 0, advance))
    moved -= moved[jump][segment]
    rank = start_item // topics + moved
    topic = start_item % topics
    in_topic = (items - topic + topics - 1) // topics  # items of each topic
    item = topic + (rank % in_topic) * topics
    order = np.arange(steps) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    return pd.DataFrame(
        {
            "user_id": pd.Series(user).map("u{}".format),
            "item_id": pd.Series(item).map("s{}".format),
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
    ids = pd.Series(np.arange(items)).map("s{}".format)
    return pd.DataFrame({"item_id": ids, "text": "Item: " + ids + "."})


def memory_needed(items: int, config: SyntheticConfig) -> int:
    """Bytes `prepare` holds at its peak for N synthetic items: the embeddings about four times
    over (them, the quantiser's copy, residual and reconstruction) and the interaction tables
    about three times (raw, split, written), ~100 bytes a row."""
    rows = users_for(items, config) * config.mean_length
    return 4 * items * config.dim * 4 + 3 * rows * 100


def available_memory() -> int:
    """MemAvailable of /proc/meminfo in bytes (what can be allocated without swapping)."""
    with open("/proc/meminfo") as info:
        for line in info:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise DataError("/proc/meminfo has no MemAvailable", "run on Linux")


def synthetic_dataset(spec: str, config: SyntheticConfig = SyntheticConfig()):
    """`load_dataset("synthetic:N")`: a RawDataset with its embeddings. Refuses, before any
    work, a size whose peak would not fit in the memory available now."""
    from genrec_spec.data_pipelines.loaders import RawDataset

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
    return RawDataset(
        name=f"synthetic-{items}",
        interactions=interactions(items, config),
        items=item_table(items),
        missing_metadata=0,
        embeddings=embeddings(items, config),
    )
