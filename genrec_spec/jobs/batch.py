"""Batch candidate generation: top-K items for many users, written as parquet shards.

    genrec-spec batch --ckpt CKPT --users users.parquet --out DIR --k 50 --decoder beam
    genrec-spec batch --ckpt CKPT --users all --out DIR --engine ray --actors 2

Users: a parquet file with a ``user_id`` column of raw user ids (the ``user_id`` of the prepared
data's splits), or ``all`` for every user of the test split, in its order. Each user's history
is every interaction the data holds for them, oldest first: the test split's history plus its
held-out item, as ``genrec-spec recommend --user`` reads it (the model sees the most recent
``max_len`` of them). Unknown or repeated ids are an error naming some of them, before any work.
A time-aware model (`models.recsys.times`) reads the data's timestamps of those items, and its
lists are for the time of each user's last interaction (what follows it).

Output: one parquet row per user with ``user_id``, ``item_ids`` (raw item ids, best first;
shorter than k only when fewer items are reachable), ``scores`` (the decoder's log-likelihoods,
float32), ``decoder``, ``model_hash`` (sha256 of the checkpoint's files) and ``data_hash`` (the
prepared data's manifest hash); see `batch_store` for the folder layout and the exactly-once
protocol. ``pd.read_parquet(DIR)`` reads all rows.

Plan (`batch_chunks`): the users, in the order given, are cut into ``--shards`` slices, each
into chunks of ``--batch-size`` users, one decoder call each in either engine. The arguments
that decide the rows (model and data hashes, users, k, decoder, options, shards, batch size) are
stored in the manifest; once a shard is complete, a rerun into the same folder with other values
is refused. Execution settings (engine, Ray address, actors, threads) may change between runs.

Engines yield (chunk, recommendations) in any order; this module (the driver, one process) keeps
the chunks of each shard and writes the shard once all of them are in. With one writer, exactly-
once needs only the atomic renames of `batch_store`, and the output folder need exist only where
the driver runs, not on Ray worker nodes.

Shape letters: U users, B users of a chunk, M history items, K list length.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import sys
import time
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import torch
from torch import Tensor
from tqdm import tqdm

from genrec_spec.jobs.batch_chunks import (
    ENGINES,
    BatchConfig,
    Chunk,
    ChunkDecoder,
    model_hash,
    plan_shards,
    run_local,
)
from genrec_spec.jobs.batch_ray import check_ray_address, run_ray
from genrec_spec.jobs.batch_store import open_store
from genrec_spec.jobs.errors import BatchInputError
from genrec_spec.recsys.checkpoint import load_model_and_data
from genrec_spec.recsys.data import Histories
from genrec_spec.recsys.decoders.registry import (
    check_option_values,
    check_options,
    get_decoder,
)
from genrec_spec.recsys.types import Recommendations

# Decoder stats that add up over chunks (the rest, e.g. rates, are per call).
COUNTED_STATS = ("target_passes", "nodes_scored", "draft_nodes", "truncated_histories")


# --- inputs ------------------------------------------------------------------------------------


def read_user_ids(users: str | Path) -> list[str]:
    """The raw user ids of a parquet file's `user_id` column, in file order."""
    path = Path(users)
    fix = "pass a parquet file with a user_id column, or `all`"
    if not path.is_file():
        raise BatchInputError(f"--users {path}: no such file", fix)
    try:
        frame = pd.read_parquet(path)
    except (OSError, ValueError) as exc:
        raise BatchInputError(
            f"--users {path} is not a readable parquet file ({exc})", fix
        ) from None
    if "user_id" not in frame:
        raise BatchInputError(f"--users {path} has no user_id column (it has {list(frame)})", fix)
    if frame["user_id"].isna().any():
        raise BatchInputError(f"--users {path} has empty user ids", fix)
    return frame["user_id"].astype(str).tolist()


def known_histories(test: Histories) -> Histories:
    """Every test user's history with the held-out item appended: all the data knows of them;
    with the data's times, their timestamps and, as the time of the prediction (`target_times`),
    the last one's."""
    lengths = test.lengths + 1  # [U]
    offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])  # [U+1]
    last = offsets[1:] - 1  # [U] where each held-out item goes
    history = torch.ones(int(offsets[-1]), dtype=torch.bool)
    history[last] = False

    def appended(per_item: Tensor, per_target: Tensor) -> Tensor:  # [M'], [U] -> [M' + U]
        out = torch.empty(len(history), dtype=per_item.dtype)
        out[history], out[last] = per_item, per_target
        return out

    values = appended(test.values, test.targets)
    times = None if test.times is None else appended(test.times, test.target_times)
    return Histories(
        user_ids=test.user_ids,
        values=values,
        offsets=offsets,
        targets=None,
        times=times,
        target_times=None if times is None else times[last],
    )


def select_users(data, users: str | Path) -> Histories:
    """The requested users' known histories, in the requested order (module docstring)."""
    known = known_histories(data.test)
    if str(users) == "all":
        return known
    user_ids = read_user_ids(users)
    if not user_ids:
        raise BatchInputError(f"--users {users} lists no users", "list at least one user")
    row = {user: i for i, user in enumerate(known.user_ids)}
    unknown = [user for user in dict.fromkeys(user_ids) if user not in row]
    if unknown:
        raise BatchInputError(
            f"{len(unknown)} unknown user id(s) in {users}: {', '.join(unknown[:10])}",
            f"list users of the data ({data.path}: {len(row)} users, e.g. "
            f"{', '.join(known.user_ids[:5])})",
        )
    repeated = pd.Series(user_ids)[pd.Series(user_ids).duplicated()].unique().tolist()
    if repeated:
        raise BatchInputError(
            f"{len(repeated)} user id(s) appear more than once in {users}: "
            f"{', '.join(repeated[:10])}",
            "list each user once",
        )
    return known.select(torch.tensor([row[user] for user in user_ids]))


def check_config(config: BatchConfig, options: dict) -> None:
    for name in ("k", "shards", "batch_size", "actors", "ray_cpus", "threads"):
        if getattr(config, name) is not None and getattr(config, name) < 1:
            flag = "--" + name.replace("_", "-")
            raise BatchInputError(
                f"{flag} must be >= 1, got {getattr(config, name)}", f"pass {flag} 1 or more"
            )
    if config.engine not in ENGINES:
        raise BatchInputError(f"unknown engine {config.engine!r}", f"use one of {ENGINES}")
    if config.ray_address and config.engine != "ray":
        raise BatchInputError(
            "--ray-address needs --engine ray", "add --engine ray, or leave out --ray-address"
        )
    check_options({config.decoder: get_decoder(config.decoder)}, options)
    try:
        json.dumps(options)
    except TypeError:
        raise BatchInputError(
            f"decoder options must be numbers, booleans or strings, got {options}",
            "pass options as NAME=VALUE with such a value",
        ) from None


def check_decoder(decoder: ChunkDecoder, histories: Histories, name: str, options: dict) -> None:
    """The options' values, then the first user decoded, before anything is written: a value the
    decoder refuses (a width below k, a float for a count, a word it does not know) fails here
    and leaves no output folder."""
    check_option_values(name, decoder.decode, options)
    first = histories.select(torch.tensor([0]))
    decoder(first.values, first.offsets, first.history_times())


# --- the job -----------------------------------------------------------------------------------


def run_batch(
    ckpt: Path | str,
    users: str | Path,  # a parquet file with user_id, or "all"
    out: Path | str,
    config: BatchConfig | None = None,  # None: the defaults
    *,
    data_dir: Path | str | None = None,  # default: the folder the checkpoint was trained on
    options: dict | None = None,  # decoder options, e.g. {"beam_width": 20}
) -> dict:
    """Write (or finish) the candidates of `users` into `out`; returns this run's summary."""
    config = config or BatchConfig()
    options = dict(options or {})
    check_config(config, options)
    if config.engine == "ray":
        check_ray_address(config.ray_address, config.ray_timeout_s)
    if config.threads is not None:  # else torch's default: every core
        torch.set_num_threads(config.threads)
    model, data = load_model_and_data(ckpt, data_dir)
    if config.k > model.num_items:
        raise BatchInputError(
            f"--k {config.k} exceeds the catalogue's {model.num_items} items",
            f"ask for at most {model.num_items} items",
        )
    histories = select_users(data, users)
    decoder = ChunkDecoder(model, config.decoder, config.k, options)
    check_decoder(decoder, histories, config.decoder, options)
    hashes = {"model_hash": model_hash(Path(ckpt)), "data_hash": data.data_hash}
    job = hashes | {
        "users_hash": hashlib.sha256("\n".join(histories.user_ids).encode()).hexdigest()[:16],
        "users": len(histories),
        "k": config.k,
        "decoder": config.decoder,
        "options": options,
        "shards": config.shards,
        "batch_size": config.batch_size,  # batching moves scores by float rounding
    }
    info = {"ckpt": str(ckpt), "data": str(data.path), "users": str(users)}
    shard_users, chunks = plan_shards(histories, config.shards, config.batch_size)
    with open_store(Path(out), job, shard_users, info) as store:
        pending = [c for shard in store.pending for c in chunks[shard]]
        done_before = sum(shard_users) - sum(len(c.user_ids) for c in pending)
        start = time.perf_counter()
        if config.engine == "ray":
            results = run_ray(Path(ckpt), hashes["model_hash"], pending, config, options)
        else:
            results = run_local(decoder, pending)
        bar = tqdm(
            total=sum(shard_users),
            initial=done_before,
            unit=" users",
            desc=f"batch {config.decoder}",
            disable=not config.progress,
            file=sys.stderr,
        )
        # closing(): an error must end the engine (e.g. shut Ray down) now, not at collection.
        with bar, contextlib.closing(results):
            item_ids = np.array(data.item_ids, dtype=object)
            stats = write_results(
                results, store, chunks, item_ids, config.decoder, hashes, bar, start
            )
        seconds = time.perf_counter() - start
        written = sum(shard_users) - done_before
        summary = {
            "users": sum(shard_users),
            "users_written": written,
            "users_resumed": done_before,
            "shards": len(shard_users),
            "engine": config.engine,
            "decoder": config.decoder,
            "k": config.k,
            "seconds": seconds,
            "users_per_s": written / seconds if written else 0.0,
            **stats,
            "out": str(out),
        }
        store.finish(summary)
    return summary


def write_results(
    results: Iterable[tuple[Chunk, Recommendations]],
    store,  # batch_store.ShardStore
    chunks: dict[int, list[Chunk]],
    item_ids: np.ndarray,  # [I] raw item id of each item index
    decoder: str,
    hashes: dict,
    bar: tqdm,
    start: float,  # perf_counter() when the engine was started
) -> dict:
    """Write each shard as soon as all its chunks are decoded; returns the summed decoder stats."""
    waiting: dict[int, dict[int, tuple[Chunk, Recommendations]]] = defaultdict(dict)
    totals = dict.fromkeys(COUNTED_STATS, 0) | {"batches": 0, "first_chunk_s": 0.0}
    later_users = 0  # users after the first chunk, whose rate excludes the engine's start-up
    for chunk, out in results:
        if totals["batches"]:
            later_users += len(chunk.user_ids)
        else:  # engine start-up plus one chunk: Ray's start shows here
            totals["first_chunk_s"] = time.perf_counter() - start
        waiting[chunk.shard][chunk.index] = (chunk, out)
        for name in COUNTED_STATS:
            totals[name] += getattr(out.stats, name) or 0
        totals["batches"] += 1
        bar.update(len(chunk.user_ids))
        if len(waiting[chunk.shard]) == len(chunks[chunk.shard]):
            done = waiting.pop(chunk.shard)
            parts = [done[i] for i in range(len(done))]
            store.write_shard(chunk.shard, shard_table(parts, item_ids, decoder, hashes))
    if waiting:  # an engine that lost a chunk is a bug, never a silently short output
        raise RuntimeError(f"the engine returned incomplete shards {sorted(waiting)}")
    totals["target_passes_per_batch"] = totals["target_passes"] / max(totals["batches"], 1)
    later_s = time.perf_counter() - start - totals["first_chunk_s"]
    totals["users_per_s_after_first"] = later_users / later_s if later_users else 0.0
    return totals


def shard_table(
    parts: list[tuple[Chunk, Recommendations]], item_ids: np.ndarray, decoder: str, hashes: dict
) -> pa.Table:
    """The rows of one shard, users in plan order; -1 pads (unreachable items) are dropped."""
    users, items, scores = [], [], []
    for chunk, out in parts:
        top, score = out.items.cpu().numpy(), out.scores.cpu().numpy()  # [B, K], [B, K]
        for row in range(len(chunk.user_ids)):
            real = top[row] >= 0
            items.append(item_ids[top[row][real]].tolist())
            scores.append(score[row][real].tolist())
        users.extend(chunk.user_ids)
    return pa.table(
        {
            "user_id": pa.array(users, pa.string()),
            "item_ids": pa.array(items, pa.list_(pa.string())),
            "scores": pa.array(scores, pa.list_(pa.float32())),
            "decoder": pa.array([decoder] * len(users), pa.string()),
            "model_hash": pa.array([hashes["model_hash"]] * len(users), pa.string()),
            "data_hash": pa.array([hashes["data_hash"]] * len(users), pa.string()),
        }
    )


def format_summary(summary: dict) -> str:
    if not summary["users_written"]:
        return (
            f"nothing to do: all {summary['users']} users of {summary['out']} were written by "
            "earlier runs"
        )
    lines = [
        f"{summary['users']} users in {summary['shards']} shards -> {summary['out']} "
        f"({summary['users_written']} written now, {summary['users_resumed']} from earlier runs)",
        f"{summary['engine']} engine, {summary['decoder']} top-{summary['k']}: "
        f"{summary['seconds']:.1f} s, {summary['users_per_s']:.1f} users/s "
        f"(first batch after {summary['first_chunk_s']:.1f} s, "
        f"{summary['users_per_s_after_first']:.1f} users/s after it)",
        f"decoder: {summary['batches']} batches, {summary['target_passes']} target passes "
        f"({summary['target_passes_per_batch']:.1f} per batch), "
        f"{summary['nodes_scored']} nodes scored, "
        f"{summary['truncated_histories']} histories cut to the model's context",
    ]
    return "\n".join(lines)
