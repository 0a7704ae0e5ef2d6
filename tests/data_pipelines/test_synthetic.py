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


def test_embeddings_cluster_in_two_levels_and_chunks_stand_alone():
    items = 1000
    x = synthetic.embeddings(items, SMALL)
    topic, group, projection = synthetic.centres(items, SMALL)  # [T, k], [G, k], [k, 384]
    assert (len(topic), len(group)) == SMALL.clusters(items) == (10, 100)
    assert np.allclose(projection @ projection.T, np.eye(SMALL.latent_dim), atol=1e-5)
    assert x.shape == (items, 384) and np.allclose(np.linalg.norm(x, axis=1), 1, atol=1e-5)
    g = np.arange(items) % len(group)

    def cosine(centres, index):
        return (x * (centres @ projection)[index]).sum(1).mean()

    # Nearer its own topic than its group, both far above the others'.
    assert cosine(topic, g % 10) > cosine(group, g) > 0.3
    assert abs(cosine(topic, (g + 1) % 10)) < 0.1 and abs(cosine(group, (g + 1) % 100)) < 0.1
    # Low intrinsic dimension: the latent directions hold almost all of each vector.
    assert np.linalg.norm(x @ projection.T, axis=1).min() > 0.9
    alone = synthetic.embedding_chunk(512, 768, (topic, group, projection), SMALL)
    assert np.array_equal(alone, x[512:768])
    assert np.array_equal(synthetic.embeddings(items, SMALL), x)  # same seed, same data


def test_users_browse_forward_inside_a_group_and_stay_near_their_topic():
    items = 3000
    frame = synthetic.interactions(items, SMALL)
    topics, groups = SMALL.clusters(items)
    assert frame["user_id"].nunique() == synthetic.users_for(items, SMALL)
    lengths = frame.groupby("user_id", sort=False).size()
    assert lengths.between(10, 30).all()
    item = frame["item_id"].str[1:].astype(int).to_numpy()
    assert ((0 <= item) & (item < items)).all()
    same_user = frame["user_id"].to_numpy()[1:] == frame["user_id"].to_numpy()[:-1]
    step = item[1:] - item[:-1]
    in_group = same_user & (step % groups == 0)
    # Most steps stay in the group, most of those to the group's next item; and jumps land in
    # the user's topic more often than chance (1 / topics).
    assert in_group.sum() / same_user.sum() > 0.8
    assert (step[in_group] == groups).mean() > 0.7
    left = same_user & ~in_group
    same_topic = (item[1:] % groups % topics) == (item[:-1] % groups % topics)
    assert same_topic[left].mean() > 0.3 > 1 / topics
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


def test_levels_follow_the_catalogue_size():
    from genrec_spec.data_pipelines.prepare import levels_for

    assert [levels_for(n, 256) for n in (1682, 3706, 10**5, 262_144)] == [3, 3, 3, 3]
    assert [levels_for(n, 256) for n in (262_145, 10**6, 10**7)] == [4, 4, 4]
    assert levels_for(10**6, 16) == 7  # 16^7 = 268M >= 64M tuples
