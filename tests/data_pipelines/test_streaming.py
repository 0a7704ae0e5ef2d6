"""Catalogues larger than memory: embeddings streamed to disk and IDs cut from it a batch at a time
give what the in-memory pipeline gives, and a failed or killed prepare leaves no output."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import faiss
import numpy as np
import pandas as pd
import pytest
import torch

from genrec_spec.data_pipelines import prepare as prepare_module
from genrec_spec.data_pipelines import synthetic
from genrec_spec.data_pipelines.atomic import atomic_dir
from genrec_spec.data_pipelines.npy_rows import NpyRows, NpyRowWriter
from genrec_spec.data_pipelines.prepare import PrepareConfig, prepare
from genrec_spec.data_pipelines.semantic_ids import (
    SemanticIdConfig,
    build_semantic_ids,
    collision_codes,
    count_unique_rows,
)

TINY = synthetic.SyntheticConfig(chunk=256)  # embeddings drawn 256 items at a time


def on_disk(path, items: int, config: synthetic.SyntheticConfig) -> NpyRows:  # [items, dim]
    with NpyRowWriter(path, (items, config.dim)) as writer:
        for chunk in synthetic.SyntheticEmbeddings(items, config).chunks():
            writer.write(chunk)
    return NpyRows(path)


def test_a_matrix_written_in_batches_is_np_saves_and_reads_back_by_rows(tmp_path):
    x = synthetic.embeddings(1000, TINY)  # [1000, 384]
    rows = on_disk(tmp_path / "streamed.npy", 1000, TINY)
    np.save(tmp_path / "whole.npy", x)
    assert (tmp_path / "streamed.npy").read_bytes() == (tmp_path / "whole.npy").read_bytes()
    assert rows.shape == (1000, 384) and np.array_equal(rows[250:700], x[250:700])
    assert np.array_equal(rows[990:5000], x[990:])


def faiss_whole_rq(x: np.ndarray, config: SemanticIdConfig) -> np.ndarray:  # [I, E] -> [I, L]
    """Residual k-means as faiss does it handed every item: it draws the training sample."""
    residual, codes = x.copy(), []
    for level in range(config.levels):
        km = faiss.Kmeans(
            x.shape[1],
            config.codebook_size,
            niter=config.niter,
            seed=config.seed + level,
            min_points_per_centroid=1,
            max_points_per_centroid=config.train_points_per_code,
        )
        km.train(residual)
        code = km.assign(residual)[1]
        residual -= km.centroids[code]
        codes.append(code)
    return np.stack(codes, axis=1)


@pytest.mark.parametrize("kind", ["rq", "pq"])
def test_ids_from_disk_in_tiny_batches_equal_the_in_memory_ids(tmp_path, kind):
    items = 2000
    x = synthetic.embeddings(items, TINY)  # [2000, 384]
    rows = on_disk(tmp_path / "emb.npy", items, TINY)
    # 16 codes x 8 points: each k-means trains on a sample of 128 of the 2,000 items.
    sizes = dict(kind=kind, levels=3, pq_digits=8, codebook_size=16, train_points_per_code=8)
    whole = build_semantic_ids(torch.from_numpy(x), SemanticIdConfig(**sizes))
    streamed = build_semantic_ids(rows, SemanticIdConfig(**sizes, batch_rows=300))
    assert torch.equal(whole.codes, streamed.codes)
    assert whole.codebook_sizes == streamed.codebook_sizes
    del whole.stats["seconds"], streamed.stats["seconds"]
    assert whole.stats == streamed.stats
    assert count_unique_rows(streamed.codes.numpy()) == items
    if kind == "rq":  # the sample is the one faiss itself would draw
        reference = faiss_whole_rq(x, SemanticIdConfig(**sizes))
        assert np.array_equal(streamed.codes[:, :3].numpy(), reference)


def test_collision_codes_and_unique_rows_over_several_words():
    rng = np.random.default_rng(0)
    # 40 columns of 8 bits: five 64-bit words; few distinct rows, so most rows repeat.
    distinct = rng.integers(0, 256, (7, 40))
    codes = distinct[rng.integers(0, 7, 500)]  # [500, 40]
    codes[:, -1] = rng.integers(0, 2, 500)  # the last word splits some groups
    rank = collision_codes(codes)
    for row in range(len(codes)):
        same = (codes[:row] == codes[row]).all(1).sum()  # earlier items with this row
        assert rank[row] == same
    assert count_unique_rows(codes) == len(np.unique(codes, axis=0))


def test_prepare_streamed_in_tiny_chunks_writes_what_the_in_memory_path_writes(
    tmp_path, monkeypatch
):
    original = synthetic.synthetic_parts

    def parts(spec, in_memory):
        fields = original(spec, TINY)
        if in_memory:  # the embeddings as one array: prepare writes them in one chunk
            fields["embeddings"] = synthetic.embeddings(len(fields["items"]), TINY)
        return fields

    config = PrepareConfig(codebook_size=16, long_id_digits=8, progress=False)
    monkeypatch.setattr(synthetic, "synthetic_parts", lambda spec: parts(spec, True))
    prepare("synthetic:2000", tmp_path / "memory", config)
    monkeypatch.setattr(synthetic, "synthetic_parts", lambda spec: parts(spec, False))
    monkeypatch.setattr(prepare_module, "ITEM_ROWS", 300)  # items.parquet in slices
    prepare(
        "synthetic:2000",
        tmp_path / "streamed",
        PrepareConfig(**{**config.__dict__, "batch_rows": 300}),
    )

    memory, streamed = (
        json.loads((tmp_path / p / "manifest.json").read_text()) for p in ("memory", "streamed")
    )
    for name in ("item_embeddings.npy", "interactions.parquet", "train.parquet", "test.parquet"):
        assert memory["files"][name] == streamed["files"][name], name
    a, b = (pd.read_parquet(tmp_path / p / "items.parquet") for p in ("memory", "streamed"))
    pd.testing.assert_frame_equal(a, b)  # the same table, cut into other row groups
    for key in ("semantic_id", "long_id"):
        del memory[key]["stats"]["seconds"], streamed[key]["stats"]["seconds"]
        assert memory[key] == streamed[key]


def test_a_size_that_fits_on_disk_only_is_accepted_by_the_memory_estimate():
    items = 10**7
    embedding_bytes = items * synthetic.SyntheticConfig().dim * 4
    assert synthetic.memory_needed(items, synthetic.SyntheticConfig()) < embedding_bytes


def test_a_failed_prepare_leaves_no_output_and_no_temporary_folder(tmp_path, monkeypatch):
    def fail(emb, config):
        raise RuntimeError("the quantiser failed")

    monkeypatch.setattr(prepare_module, "_build_ids", fail)
    with pytest.raises(RuntimeError, match="quantiser failed"):
        prepare("synthetic:600", tmp_path / "out", PrepareConfig(codebook_size=16, progress=False))
    assert list(tmp_path.iterdir()) == []


def start_prepare(out):  # a prepare slow enough to be caught writing, in a child process
    command = [sys.executable, "-m", "genrec_spec.cli", "prepare", "--dataset", "synthetic:5000"]
    child = subprocess.Popen(
        [*command, "--out", str(out), "--no-progress"], stdout=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 60
    while not list(out.parent.glob(f".{out.name}.tmp-*/item_embeddings.npy")):
        assert child.poll() is None and time.monotonic() < deadline, "prepare was not caught"
        time.sleep(0.02)
    return child


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL])
def test_a_killed_prepare_leaves_no_output(tmp_path, how):
    out = tmp_path / "out"
    child = start_prepare(out)
    os.kill(child.pid, how)
    code = child.wait(timeout=60)
    assert not out.exists()
    left = list(tmp_path.iterdir())
    if how == signal.SIGTERM:  # unwinds like Ctrl-C: the temporary folder is removed
        assert code == 130 and left == []
    else:  # killed outright: the next writer of the same folder removes what it left
        assert code == -signal.SIGKILL and len(left) == 1
        with atomic_dir(out) as tmp:
            (tmp / "done").write_text("")
        assert [p.name for p in tmp_path.iterdir()] == ["out"]
