"""Fixtures shared by every test folder: the real ML-100K prepared folder (slow tests), a tiny
random prepared-data folder written in the format of `genrec-spec prepare`, a tiny model on it and
a tiny checkpoint of that model.

Fixtures return functions/paths rather than sibling-module helpers because the suite runs in
importlib mode, where test modules cannot import each other.
"""

import hashlib
import json
import os
import socket
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

# Nothing can be fetched from a model hub here; a hub lookup would only waste time.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# Without a CUDA GPU the Triton kernel runs in the interpreter. The switch is read when triton is
# imported, and torch, torchrec or fbgemm may import triton while other test folders are
# collected, so it is set here, in the first conftest pytest loads. It is process-wide; that is
# harmless because on CPU only the kernel tests ask for backend="triton".
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    """A test marked `gpu` is skipped where there is no CUDA GPU: collected everywhere (its
    module imports without one), run by `gpu-check` where there is one."""
    if torch.cuda.is_available():
        return
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))


@pytest.fixture(scope="session")
def ml100k_dir(tmp_path_factory) -> Path:
    """MovieLens-100K through the whole data pipeline, once per test session (slow cold; the
    item embeddings come from the user's embedding cache when it has them)."""
    from genrec_spec.data_pipelines.prepare import PrepareConfig, prepare

    out = tmp_path_factory.mktemp("prepared") / "ml-100k"
    prepare("ml-100k", out, PrepareConfig(progress=False))
    return out


TINY_LEVELS = (6, 5)  # quantiser codebook sizes; a collision level is appended
TINY_DIGITS, TINY_DIGIT_SIZE = 4, 4  # long IDs


def write_tiny_prepared(
    path: Path, items: int = 40, users: int = 24, max_len: int = 14, seed: int = 0
) -> Path:
    """A prepared folder with random unique Semantic IDs and learnable sequences: each user walks
    the catalogue mostly by +1 steps (item i -> i + 1), so next-item loss can fall."""
    rng = np.random.default_rng(seed)
    codes = np.stack([rng.integers(0, v, items) for v in TINY_LEVELS], axis=1)
    collision = np.zeros(items, dtype=np.int64)
    seen: dict[tuple, int] = {}
    for i, key in enumerate(map(tuple, codes)):
        collision[i] = seen.get(key, 0)
        seen[key] = collision[i] + 1
    semantic_id = np.concatenate([codes, collision[:, None]], axis=1).astype(np.int64)
    sizes = [*TINY_LEVELS, int(collision.max()) + 1]
    long_id = rng.integers(0, TINY_DIGIT_SIZE, (items, TINY_DIGITS)).astype(np.int64)

    path.mkdir(parents=True)
    pd.DataFrame(
        {
            "item_index": np.arange(items),
            "item_id": [f"i{i}" for i in range(items)],
            "text": [f"item {i}" for i in range(items)],
            "title": [f"Movie number {i}" for i in range(items)],  # for the llm decoder
            "year": [str(1950 + i) for i in range(items)],
            "semantic_id": list(semantic_id),
            "long_id": list(long_id),
        }
    ).to_parquet(path / "items.parquet", index=False)
    rows = {"train": [], "valid": [], "test": [], "interactions": []}
    clock = np.random.default_rng(seed + 1)  # the times' own, so the items stay as they were
    for u in range(users):
        n = int(rng.integers(3, max_len + 3))
        steps = np.where(rng.random(n) < 0.85, 1, rng.integers(2, items, n))
        seq = (int(rng.integers(items)) + np.cumsum(steps)) % items
        user = f"u{u}"
        rows["train"].append({"user_id": user, "history": seq[:-2]})
        rows["valid"].append({"user_id": user, "history": seq[:-2], "target": seq[-2]})
        rows["test"].append({"user_id": user, "history": seq[:-1], "target": seq[-1]})
        # Timestamps rising by gaps of 0 s (a burst) to months, in the split's order
        gaps = np.where(clock.random(n) < 0.3, 0, (10 ** clock.uniform(0, 7, n)).astype(int))
        times = 978_000_000 + np.cumsum(gaps)
        rows["interactions"] += [
            {"user_id": user, "item_id": f"i{i}", "timestamp": t, "rating": 4.0, "item_index": i}
            for i, t in zip(seq.tolist(), times.tolist(), strict=True)
        ]
    for name, frame in rows.items():
        pd.DataFrame(frame).to_parquet(path / f"{name}.parquet", index=False)
    np.save(path / "item_embeddings.npy", rng.standard_normal((items, 8)).astype(np.float32))
    files = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}
    manifest = {
        "name": "tiny",
        "semantic_id": {"levels": len(sizes), "codebook_sizes": sizes, "collisions": 0},
        "long_id": {"levels": TINY_DIGITS, "codebook_sizes": [TINY_DIGIT_SIZE] * TINY_DIGITS},
        "files": files,
        "data_hash": hashlib.sha256(json.dumps(files).encode()).hexdigest()[:16],
    }
    (path / "manifest.json").write_text(json.dumps(manifest))
    return path


@pytest.fixture
def linear_mode(monkeypatch):
    """Sets the native Llama's CPU linear mode for one test (``GENREC_SPEC_CPU_LINEAR``, which
    the process reads once): ``linear_mode("packed")``. The process reads it afresh afterwards."""
    from genrec_spec.models.llm import cpu_linear

    def force(value: str) -> None:
        monkeypatch.setenv(cpu_linear.MODE_ENV, value)
        cpu_linear.forget()

    yield force
    cpu_linear.forget()


@pytest.fixture
def free_port() -> int:
    """A loopback TCP port nobody listens on (bound once by the OS, then released)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def tiny_data_dir(tmp_path: Path) -> Path:
    return write_tiny_prepared(tmp_path / "tiny")


@pytest.fixture(scope="session")
def tiny_prepared():
    """The writer itself, for tests that need other sizes."""
    return write_tiny_prepared


def tiny_recommender_config():
    """The tiny test recommender: every head and the item objective (dot-product logits),
    dropout 0, level 0 from its own code head, levels 1.. from theirs (tests of the item
    objective's level0, tied_levels and temperature turn them on)."""
    from genrec_spec.models.recsys.config import (
        DraftHeadConfig,
        ItemObjectiveConfig,
        RecommenderConfig,
    )

    return RecommenderConfig(
        dim=16,
        layers=2,
        heads=2,
        dropout=0.0,
        max_len=12,
        draft_head=DraftHeadConfig(hidden=8),
        item_objective=ItemObjectiveConfig(
            temperature=0.0, level0=False, tied_levels=None, draft=False
        ),
    )


@pytest.fixture
def tiny_model(tiny_data_dir: Path):
    """(model in eval mode with dropout 0, all heads and the item objective, its
    PreparedData)."""
    from genrec_spec.models.recsys.recommender import SemanticIdRecommender
    from genrec_spec.recsys.data import load_prepared

    torch.manual_seed(0)
    data = load_prepared(tiny_data_dir)
    config = tiny_recommender_config()
    model = SemanticIdRecommender(
        config, data.item_codes, data.codebook_sizes, data.long_ids, data.long_id_sizes
    )
    return model.eval(), data


@pytest.fixture(params=["transformer", "hstu", "hstu-relative-bias"])
def block_model(request, tiny_data_dir: Path):
    """`tiny_model` built with each kind of block (`RecommenderConfig.block`), and HSTU blocks
    with their relative position bias (`relative_bias`), drawn far from its small initial
    values so that a wrong distance anywhere shows."""
    from genrec_spec.models.recsys.recommender import SemanticIdRecommender
    from genrec_spec.recsys.data import load_prepared

    torch.manual_seed(0)
    data = load_prepared(tiny_data_dir)
    block, *bias = request.param.split("-", 1)
    config = replace(tiny_recommender_config(), block=block, relative_bias=bool(bias))
    model = SemanticIdRecommender(
        config, data.item_codes, data.codebook_sizes, data.long_ids, data.long_id_sizes
    )
    for layer in model.blocks if bias else ():
        layer.relative_bias.data.normal_()
    return model.eval(), data


def write_tiny_checkpoint(root: Path, users: int = 24, **changes) -> Path:
    """A checkpoint folder of an untrained tiny model (all heads; `changes` to its config) on
    its own tiny data folder of `users` users, with the manifest `genrec-spec train` writes
    (data path and hash)."""
    from genrec_spec.models.recsys.recommender import SemanticIdRecommender
    from genrec_spec.recsys.checkpoint import save_checkpoint
    from genrec_spec.recsys.data import load_prepared

    data = load_prepared(write_tiny_prepared(root / "data", users=users))
    torch.manual_seed(0)
    config = replace(tiny_recommender_config(), **changes)
    model = SemanticIdRecommender(
        config, data.item_codes, data.codebook_sizes, data.long_ids, data.long_id_sizes
    )
    manifest = {"data": {"path": str(data.path), "data_hash": data.data_hash, "name": "tiny"}}
    save_checkpoint(root / "ckpt", model, manifest)
    return root / "ckpt"


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """`write_tiny_checkpoint`'s 24-user checkpoint, for product tests that load from disk;
    read-only, shared by the session."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_checkpoint"))


@pytest.fixture(scope="session")
def tiny_checkpoint_writer():
    """The writer itself, for tests that need more users."""
    return write_tiny_checkpoint


@pytest.fixture(scope="session")
def smollm2_model():
    """The real SmolLM2-135M-Instruct as a native Llama, and its tokenizer (loaded once)."""
    from genrec_spec.models.llm.smollm2 import load_smollm2

    return load_smollm2()
