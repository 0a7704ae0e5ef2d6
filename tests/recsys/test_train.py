"""`genrec-spec train`: loss goes down, checkpoints round-trip, bad input, reproducibility, heads
after a frozen backbone, DistributedDataParallel with 2 processes, and (slow) real ML-100K."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from genrec_spec.cli.train import add_arguments, run
from genrec_spec.data_pipelines.errors import DataError
from genrec_spec.models.recsys.item_scores import item_log_likelihoods
from genrec_spec.recsys.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from genrec_spec.recsys.data import load_prepared
from genrec_spec.recsys.train_config import TrainConfig, load_config
from genrec_spec.recsys.trainer import _epochs_that_fit, _warmup_cosine, train

REPO = Path(__file__).resolve().parents[2]
TINY_MODEL = {"dim": 16, "layers": 2, "heads": 2, "max_len": 12, "dropout": 0.0}
TINY_TRAIN = {
    "epochs": 4,
    "batch_size": 16,
    "warmup_steps": 4,
    "valid_users": 0,
    "threads": 1,
    "progress": False,
    "window": "last",
    "branches_per_row": 16,  # >= every window: no sampled positions, deterministic batches
    "patience": 10,
}


def _train(data: Path, out: Path, **train_overrides) -> dict:
    model_config, train_config = load_config(
        None, {"model": TINY_MODEL, "train": {**TINY_TRAIN, **train_overrides}}
    )
    return train(data, out, model_config, train_config)


def _cli(args: list[str]) -> int:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return run(parser.parse_args(args))


def test_training_lowers_loss_and_writes_a_checkpoint(tiny_prepared, tmp_path):
    data = tiny_prepared(tmp_path / "data", users=48)
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model": TINY_MODEL, "train": {**TINY_TRAIN, "epochs": 5}}))
    assert (
        _cli(["--data", str(data), "--out", str(tmp_path / "ckpt"), "--config", str(config)]) == 0
    )

    model, manifest = load_checkpoint(tmp_path / "ckpt")
    losses = [epoch["train_loss"] for epoch in manifest["metrics"]]
    assert len(losses) == 5 and losses[-1] < losses[0] - 0.3
    assert manifest["data"]["data_hash"] == load_prepared(data).data_hash
    assert manifest["model_config"]["dim"] == 16 and manifest["train_config"]["epochs"] == 5
    assert manifest["best"]["ndcg@10"] == max(e["ndcg@10"] for e in manifest["metrics"])
    assert {"torch", "torchrec", "python"} <= set(manifest["versions"])
    assert {"hr@10", "ndcg@10", "parallel_hr@10", "long_id_ndcg@10"} <= set(manifest["best"])
    assert not model.training and model.num_items == 40


def test_checkpoint_round_trip(tiny_model, tmp_path):
    model, data = tiny_model
    manifest = save_checkpoint(tmp_path / "ckpt", model, {"data": {"data_hash": data.data_hash}})
    loaded, read = load_checkpoint(tmp_path / "ckpt")
    assert read == json.loads(json.dumps(manifest))
    values, offsets = torch.tensor([1, 5, 7, 2, 3]), torch.tensor([0, 3, 5])
    a, b = model.encode_history(values, offsets), loaded.encode_history(values, offsets)
    torch.testing.assert_close(a.level0_log_probs, b.level0_log_probs)
    everything = torch.arange(40)
    torch.testing.assert_close(
        item_log_likelihoods(model, a, everything), item_log_likelihoods(loaded, b, everything)
    )
    with pytest.raises(FileExistsError, match="--overwrite"):
        save_checkpoint(tmp_path / "ckpt", model, {})
    # A manifest from before the item objective existed: that model was trained without it.
    path = tmp_path / "ckpt" / "manifest.json"
    old = json.loads(path.read_text())
    for option in (
        "item_weight",
        "level0_from_items",
        "item_tied_levels",
        "item_temperature",
        "item_levels_residual",
        "draft_tied",
        "heads_item_loss",
        "head_position_stride",
    ):
        del old["model_config"][option]
    path.write_text(json.dumps(old))
    assert loaded.config.item_weight == 1.0
    old_config = load_checkpoint(tmp_path / "ckpt")[0].config
    assert (old_config.item_weight, old_config.level0_from_items) == (0.0, False)
    assert not old_config.item_tied_levels and old_config.item_temperature == 0.0
    assert not old_config.item_levels_residual and not old_config.draft_tied
    assert not old_config.heads_item_loss and old_config.head_position_stride == 0
    # A manifest with a model option this code lacks (a newer or patched version wrote it).
    path.write_text(json.dumps(old | {"model_config": old["model_config"] | {"warp": 2.0}}))
    with pytest.raises(CheckpointError, match=r"does not know: \['warp'\].*retrain"):
        load_checkpoint(tmp_path / "ckpt")


def test_seeded_training_is_reproducible(tiny_data_dir, tmp_path):
    random_parts = {"epochs": 1, "window": "random", "branches_per_row": 2}
    first = _train(tiny_data_dir, tmp_path / "a", **random_parts)["metrics"]
    second = _train(tiny_data_dir, tmp_path / "b", **random_parts)["metrics"]
    drop = ("epoch_s",)
    assert [{k: v for k, v in e.items() if k not in drop} for e in first] == [
        {k: v for k, v in e.items() if k not in drop} for e in second
    ]


def test_heads_after_a_frozen_backbone(tiny_data_dir, tmp_path):
    _train(tiny_data_dir, tmp_path / "base", epochs=1)
    base, _ = load_checkpoint(tmp_path / "base")
    _train(
        tiny_data_dir,
        tmp_path / "heads",
        epochs=2,
        freeze_backbone=True,
        init_from=str(tmp_path / "base"),
    )
    tuned, _ = load_checkpoint(tmp_path / "heads")
    before, after = base.state_dict(), tuned.state_dict()
    heads = ("parallel_heads.", "long_id_heads.", "draft_head.")
    assert all(torch.equal(before[k], after[k]) for k in before if not k.startswith(heads))
    assert any(not torch.equal(before[k], after[k]) for k in before if k.startswith(heads))
    # One head retrained (the others' loss weights 0): the others stay exactly as they were.
    model_config, train_config = load_config(
        None,
        {
            "model": {**TINY_MODEL, "parallel_weight": 0.0, "long_id_weight": 0.0},
            "train": {
                **TINY_TRAIN,
                "epochs": 2,
                "freeze_backbone": True,
                "init_from": str(tmp_path / "base"),
            },
        },
    )
    train(tiny_data_dir, tmp_path / "draft", model_config, train_config)
    after = load_checkpoint(tmp_path / "draft")[0].state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before if not k.startswith("draft_head."))
    assert any(not torch.equal(before[k], after[k]) for k in before if k.startswith("draft_head."))


def test_shipped_configs_load_and_ml1m_is_the_default():
    from dataclasses import replace

    from genrec_spec.models.recsys.recommender import RecommenderConfig

    assert load_config(REPO / "configs" / "ml-1m.json") == (RecommenderConfig(), TrainConfig())
    model_config, train_config = load_config(REPO / "configs" / "ml-100k-demo.json")
    assert model_config.max_len == 50 and train_config.max_minutes < 3
    # The two-process recipe as measured: the default model without the item objective (which
    # came later), twice the epochs in the same budget.
    model_config, train_config = load_config(REPO / "configs" / "ml-1m-ddp.json")
    assert (
        replace(
            model_config,
            item_weight=1.0,
            level0_from_items=True,
            item_tied_levels=True,
            item_levels_residual=True,
            draft_tied=True,
            heads_item_loss=True,
            detach_heads=True,
            head_position_stride=2,
        )
        == RecommenderConfig()
    )
    assert train_config.epochs == 80
    assert train_config.max_minutes == TrainConfig().max_minutes


def test_schedule_decays_within_the_time_budget():
    """The cosine spans the epochs that fit in max_minutes at the last epoch's speed, so a run
    cut by the budget still ends at the floor (0.1 x lr)."""
    config = TrainConfig(epochs=25, max_minutes=10)
    assert _epochs_that_fit(1, config, elapsed_s=70, epoch_s=60) == 9  # 530 s left: 8 more
    assert _epochs_that_fit(9, config, elapsed_s=560, epoch_s=60) == 9  # 40 s left: stop
    assert _epochs_that_fit(1, TrainConfig(epochs=4, max_minutes=10), 70, 60) == 4
    assert _warmup_cosine(0, 10, 100) == pytest.approx(0.1)
    assert _warmup_cosine(9, 10, 100) == pytest.approx(1.0)
    assert _warmup_cosine(55, 10, 100) == pytest.approx(0.55)
    assert _warmup_cosine(100, 10, 100) == _warmup_cosine(500, 10, 100) == pytest.approx(0.1)


def test_bad_input_is_reported_clearly(tiny_data_dir, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"model": {"dimm": 8}}))
    with pytest.raises(ValueError, match=r"unknown keys \['dimm'\]; valid keys: \['dim'"):
        load_config(bad)
    bad.write_text(json.dumps({"optimizer": {}}))
    with pytest.raises(ValueError, match=r"unknown sections \['optimizer'\]"):
        load_config(bad)
    with pytest.raises(ValueError, match="init_from"):
        load_config(None, {"train": {"freeze_backbone": True}})

    with pytest.raises(DataError, match="genrec-spec prepare"):
        load_prepared(tmp_path / "nowhere")
    (tiny_data_dir / "valid.parquet").unlink()
    with pytest.raises(DataError, match="no valid.parquet.*genrec-spec prepare"):
        load_prepared(tiny_data_dir)

    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("")
    with pytest.raises(FileExistsError, match="--overwrite"):
        _train(tiny_data_dir, tmp_path / "taken")


def test_two_processes_match_one(tiny_prepared, tmp_path, free_port):
    """torchrun with 2 gloo processes: same global batches, so the same losses and metrics as
    one process up to float reduction order (each process averages its own half)."""
    data = tiny_prepared(tmp_path / "data", users=64)
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model": TINY_MODEL, "train": {**TINY_TRAIN, "epochs": 3}}))
    script = tmp_path / "train_cli.py"
    script.write_text(
        "import argparse, sys\n"
        "from genrec_spec.cli.train import add_arguments, run\n"
        "p = argparse.ArgumentParser(); add_arguments(p); sys.exit(run(p.parse_args()))\n"
    )
    # Loopback only: `--standalone` advertises socket.getfqdn() as the master address, and where
    # the host name resolves to an unreachable address the workers wait for it silently (a CI run
    # hung at this test until its 90-minute limit; reproduced here by patching getfqdn); gloo
    # likewise binds the interface its host name resolves to.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    common = [str(script), "--data", str(data), "--config", str(config)]
    launches = {
        "one": [sys.executable, *common],
        "two": [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=1",
            "--nproc-per-node=2",
            "--master-addr=127.0.0.1",
            f"--master-port={free_port}",
            *common,
        ],
    }
    for out, command in launches.items():
        # Its own session, so that a hang is killed with torchrun's workers (14-27 s here).
        run = subprocess.Popen(
            [*command, "--out", str(tmp_path / out)],
            env=env,
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            _, stderr = run.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            os.killpg(run.pid, signal.SIGKILL)
            pytest.fail(
                f"{out}: still running after 300 s; stderr {run.communicate()[1][-3000:]!r}"
            )
        assert run.returncode == 0, stderr[-3000:]
    one = json.loads((tmp_path / "one" / "manifest.json").read_text())
    two = json.loads((tmp_path / "two" / "manifest.json").read_text())
    assert (one["world_size"], two["world_size"]) == (1, 2)
    for a, b in zip(one["metrics"], two["metrics"], strict=True):
        assert a["steps"] == b["steps"] and a["valid_users"] == b["valid_users"]
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=0.02)
        assert abs(a["ndcg@10"] - b["ndcg@10"]) < 0.05


@pytest.mark.slow
def test_ml100k_demo_config_learns(ml100k_dir, tmp_path):
    """5 epochs (150 steps) of the demo config on real ML-100K beat popularity, which ranks
    the valid targets at HR@10 0.038 (the 10 most frequent train items)."""
    model_config, train_config = load_config(
        REPO / "configs" / "ml-100k-demo.json",
        {"train": {"epochs": 5, "max_minutes": 0, "patience": 5, "progress": False}},
    )
    manifest = train(ml100k_dir, tmp_path / "ckpt", model_config, train_config)
    assert sum(e["steps"] for e in manifest["metrics"]) >= 140
    assert manifest["best"]["hr@10"] > 0.05
