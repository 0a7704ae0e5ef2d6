"""The synthetic catalogue: clustered embeddings, browsing users, chunks that stand alone, the
whole pipeline on it, and sizes that do not fit refused before any work."""

from __future__ import annotations

import json
import time

import numpy as np
import pandas as pd
import pytest

from genrec_spec.data_pipelines import synthetic
from genrec_spec.data_pipelines.errors import DataError
from genrec_spec.data_pipelines.loaders import load_dataset
from genrec_spec.data_pipelines.prepare import PrepareConfig, prepare

SMALL = synthetic.SyntheticConfig(chunk=256)


def test_embeddings_cluster_around_their_topics_and_chunks_stand_alone():
    items = 1000
    x = synthetic.embeddings(items, SMALL)
    centres = synthetic.topic_centres(items, SMALL)  # [T, 384]
    assert x.shape == (items, 384) and np.allclose(np.linalg.norm(x, axis=1), 1, atol=1e-5)
    own = (x * centres[np.arange(items) % len(centres)]).sum(1)
    other = (x * centres[(np.arange(items) + 1) % len(centres)]).sum(1)
    assert 0.6 < own.mean() < 0.8 and abs(other.mean()) < 0.05
    alone = synthetic.embedding_chunk(items, 512, 768, centres, SMALL)
    assert np.array_equal(alone, x[512:768])
    assert np.array_equal(synthetic.embeddings(items, SMALL), x)  # same seed, same data


def test_users_browse_forward_inside_a_topic():
    items = 3000
    frame = synthetic.interactions(items, SMALL)
    topics = SMALL.topics(items)
    assert frame["user_id"].nunique() == synthetic.users_for(items, SMALL)
    lengths = frame.groupby("user_id", sort=False).size()
    assert lengths.between(10, 30).all()
    item = frame["item_id"].str[1:].astype(int).to_numpy()
    assert ((0 <= item) & (item < items)).all()
    same_user = frame["user_id"].to_numpy()[1:] == frame["user_id"].to_numpy()[:-1]
    step = item[1:] - item[:-1]
    in_topic = same_user & (step % topics == 0)
    # Most steps stay in the topic, and most of those go to the next item of the topic.
    assert in_topic.sum() / same_user.sum() > 0.8
    assert (step[in_topic] == topics).mean() > 0.7
    assert (
        frame.groupby("user_id", sort=False)["timestamp"]
        .apply(lambda t: t.is_monotonic_increasing)
        .all()
    )


@pytest.mark.parametrize("spec", ["synthetic:", "synthetic:ten", "synthetic:1", "synthetic:2.5"])
def test_a_spec_without_a_size_is_refused(spec):
    with pytest.raises(DataError, match="does not give a catalogue size"):
        load_dataset(spec)


def test_a_size_that_does_not_fit_is_refused_before_any_work(tmp_path):
    start = time.perf_counter()
    with pytest.raises(DataError, match=r"needs about .* GiB at its peak; .* GiB are available"):
        prepare("synthetic:1e12", tmp_path / "out", PrepareConfig(progress=False))
    assert time.perf_counter() - start < 5 and not (tmp_path / "out").exists()


def test_prepare_runs_the_whole_pipeline_on_it(tmp_path):
    out = tmp_path / "syn"
    config = PrepareConfig(codebook_size=16, long_id_digits=8, progress=False)
    manifest = prepare("synthetic:600", out, config)
    assert manifest["counts"]["items"] == 600 and manifest["embedding"]["encoder"] == "synthetic"
    assert manifest["semantic_id"]["codebook_sizes"][:3] == [16, 16, 16]
    items = pd.read_parquet(out / "items.parquet")
    codes = np.stack(items["semantic_id"].to_numpy())
    assert len(np.unique(codes, axis=0)) == 600  # every item its own ID
    saved = np.load(out / "item_embeddings.npy")
    assert np.array_equal(saved, synthetic.embeddings(600, synthetic.SyntheticConfig()))
    assert json.loads((out / "manifest.json").read_text())["name"] == "synthetic-600"
