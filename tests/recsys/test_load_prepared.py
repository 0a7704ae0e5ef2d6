"""Reading a prepared folder (``recsys.data.load_prepared``): the tables come back as written,
whatever order the item rows are stored in, and a malformed item table is refused with the fix."""

import numpy as np
import pandas as pd
import pytest
import torch

from genrec_spec.data_pipelines.errors import DataError
from genrec_spec.recsys.data import load_prepared


def test_tables_come_back_as_written(tiny_data_dir):
    items = pd.read_parquet(tiny_data_dir / "items.parquet")
    test = pd.read_parquet(tiny_data_dir / "test.parquet")
    data = load_prepared(tiny_data_dir)
    assert data.item_ids == items["item_id"].tolist()
    assert torch.equal(data.item_codes, torch.tensor(np.stack(items["semantic_id"])))
    assert torch.equal(data.long_ids, torch.tensor(np.stack(items["long_id"])))
    assert data.test.user_ids == test["user_id"].tolist()
    assert torch.equal(data.test.targets, torch.tensor(test["target"].to_numpy()))
    histories = [data.test.values[a:b].tolist() for a, b in data.test.offsets.unfold(0, 2, 1)]
    assert histories == [list(h) for h in test["history"]]
    assert data.train.targets is None


def test_item_rows_in_any_order(tiny_data_dir):
    before = load_prepared(tiny_data_dir)
    items = pd.read_parquet(tiny_data_dir / "items.parquet")
    items.sample(frac=1.0, random_state=0).to_parquet(tiny_data_dir / "items.parquet")
    after = load_prepared(tiny_data_dir)
    assert after.item_ids == before.item_ids
    assert torch.equal(after.item_codes, before.item_codes)
    assert torch.equal(after.long_ids, before.long_ids)


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda items: items.drop(columns="semantic_id"), "no semantic_id column"),
        (lambda items: items.assign(item_index=items["item_index"] + 1), "not 0..I-1"),
        (
            lambda items: items.assign(
                semantic_id=[codes[: 1 + (i % 2)] for i, codes in enumerate(items["semantic_id"])]
            ),
            "lists of lengths 1 to 2",
        ),
    ],
    ids=["missing-column", "item-index-gap", "ragged-ids"],
)
def test_a_malformed_item_table_is_refused(tiny_data_dir, damage, message):
    items = pd.read_parquet(tiny_data_dir / "items.parquet")
    damage(items).to_parquet(tiny_data_dir / "items.parquet", index=False)
    with pytest.raises(DataError, match=message) as caught:
        load_prepared(tiny_data_dir)
    assert "genrec-spec prepare" in str(caught.value)


def test_a_file_or_a_checkpoint_as_data_names_the_fix(tiny_data_dir, tmp_path):
    """A file is not "missing"; and where the folder is not one prepare wrote (a checkpoint, a
    user's folder) the fix never suggests --overwrite, which would delete it."""
    with pytest.raises(DataError, match="is a file, not a prepared folder"):
        load_prepared(tiny_data_dir / "manifest.json")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "manifest.json").write_text('{"model_config": {}}')
    with pytest.raises(DataError, match="has no items.parquet") as refused:
        load_prepared(ckpt)
    assert "--overwrite" not in str(refused.value)
    (tiny_data_dir / "train.parquet").write_bytes(b"PAR1 cut short")  # (arrow's message)
    with pytest.raises(DataError, match="train.parquet cannot be read as parquet.*Fix: re-create"):
        load_prepared(tiny_data_dir)
    (tiny_data_dir / "manifest.json").write_text("not json")  # (a JSON decoder's message)
    with pytest.raises(DataError, match="manifest.json is not JSON"):
        load_prepared(tiny_data_dir)
