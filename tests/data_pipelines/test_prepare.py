"""`genrec-spec prepare` end to end: real ML-100K, and bad input that must leave nothing behind."""

import json

import numpy as np
import pandas as pd
import pytest

from genrec_spec.cli import main


def test_ml100k_outputs_are_complete_and_consistent(ml100k_dir):
    manifest = json.loads((ml100k_dir / "manifest.json").read_text())
    assert manifest["counts"] == {"users": 943, "items": 1682, "interactions": 100_000}
    assert manifest["semantic_id"]["collisions"] == 0
    assert manifest["semantic_id"]["levels"] == 4  # 3 RQ levels + the collision code
    assert set(manifest["files"]) == {
        "items.parquet",
        "interactions.parquet",
        "train.parquet",
        "valid.parquet",
        "test.parquet",
        "item_embeddings.npy",
    }

    items = pd.read_parquet(ml100k_dir / "items.parquet")
    assert (items["item_index"].to_numpy() == np.arange(1682)).all()
    codes = np.stack(items["semantic_id"].to_numpy())  # [I, 4]
    assert len({tuple(c) for c in codes.tolist()}) == 1682
    assert codes[:, :3].max() < 256
    long_ids = np.stack(items["long_id"].to_numpy())
    assert long_ids.shape[1] >= 32

    emb = np.load(ml100k_dir / "item_embeddings.npy")
    assert emb.shape == (1682, 384)
    np.testing.assert_allclose(np.linalg.norm(emb, axis=1), 1.0, atol=1e-5)

    test = pd.read_parquet(ml100k_dir / "test.parquet")
    valid = pd.read_parquet(ml100k_dir / "valid.parquet")
    assert len(test) == len(valid) == 943
    inter = pd.read_parquet(ml100k_dir / "interactions.parquet")
    assert len(inter) == 100_000 and (inter["item_index"] >= 0).all()


def _run(capsys, *argv) -> tuple[int, str]:
    code = main(["prepare", *argv, "--no-progress"])
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--dataset", "ml-10m"], "unknown dataset"),
        (["--dataset", "movielens:/nonexistent/folder"], "/nonexistent/folder"),
        (["--dataset", "ml-100k", "--codebook-size", "4096"], "--codebook-size"),
        (["--dataset", "ml-100k", "--levels", "0"], "--levels"),
        (["--dataset", "ml-100k", "--levels", "100"], "--levels 100 must be 1 to"),
    ],
)
def test_bad_input_is_one_clear_error_and_leaves_no_output(tmp_path, capsys, argv, expected):
    out = tmp_path / "out"
    code, err = _run(capsys, *argv, "--out", str(out))
    assert code == 2
    assert expected.lower() in err.lower() and "Fix:" in err
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []  # no temporary folder left behind either


def test_existing_output_is_kept_unless_overwrite(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("previous run")
    code, err = _run(capsys, "--dataset", "ml-10m", "--out", str(out))
    assert code == 2 and (out / "keep.txt").read_text() == "previous run"
    code, err = _run(capsys, "--dataset", "ml-100k", "--out", str(out))
    assert code == 2 and "--overwrite" in err
    assert (out / "keep.txt").exists()
