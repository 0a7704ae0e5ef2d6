"""`genrec-spec replay`: paired bootstrap statistics, beam vs spec_beam equality, the report,
atomic output, log replay, and bad input through the CLI."""

from __future__ import annotations

import base64
import json
import math
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from genrec_spec.cli import main
from genrec_spec.jobs import replay as rp
from genrec_spec.jobs import replay_arms as arms
from genrec_spec.jobs import replay_compare as cmp
from genrec_spec.jobs import replay_events as ev
from genrec_spec.recsys.checkpoint import load_model_and_data, save_checkpoint
from genrec_spec.recsys.decoders.registry import get_decoder
from genrec_spec.recsys.evaluate import evaluate

FAST = ["--bootstrap", "200", "--batch-size", "5"]


def _replay(argv: list[str], capsys) -> tuple[int, str, str]:
    code = main(["replay", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# --- statistics ----------------------------------------------------------------------------------


def test_bootstrap_interval_covers_the_known_difference_at_its_nominal_rate():
    rng = np.random.default_rng(0)
    true_diff, repeats = 0.25, 300
    # 300 independent paired samples of 300 users each, one row per sample.
    a = torch.tensor(rng.normal(1.0, 1.0, (repeats, 300)))
    b = a + true_diff + torch.tensor(rng.normal(0.0, 0.5, (repeats, 300)))  # B shares A's part
    names = [f"sample{i}" for i in range(repeats)]
    config = arms.ReplayConfig(bootstrap=1000)
    diffs = cmp.metric_differences(a, b, names, config, torch.Generator().manual_seed(0))
    covered = sum(d["low"] <= true_diff <= d["high"] for d in diffs.values())
    assert 0.9 <= covered / repeats <= 0.99, covered / repeats
    assert all(d["significant"] for d in diffs.values())  # 0.25 is ~9 standard errors from 0


def test_bootstrap_interval_matches_the_normal_theory_interval_and_stays_paired():
    rng = np.random.default_rng(1)
    a = torch.tensor(rng.normal(0.0, 1.0, 2000))
    b = a + 0.1 + torch.tensor(rng.normal(0.0, 0.3, 2000))
    rows = torch.stack([a, b, b - a])  # [3, 2000]
    replicates = cmp.bootstrap_means(rows, 3000, torch.Generator().manual_seed(0))  # [3, 3000]
    # One draw for every row: the difference row's replicates are the rows' differences.
    torch.testing.assert_close(replicates[2], replicates[1] - replicates[0])
    low, high = cmp.interval(replicates, 0.95)
    half_width = 1.96 * (b - a).std() / math.sqrt(2000)  # normal-theory 95% half-width
    assert abs((high[2] - low[2]) / 2 - half_width) < 0.1 * half_width
    assert abs((high[2] + low[2]) / 2 - (b - a).mean()) < 0.2 * half_width
    # Resampled pairs are much narrower than unpaired noise would be.
    assert high[2] - low[2] < 0.5 * (high[1] - low[1])


def test_user_bootstrap_widens_intervals_for_correlated_events_of_one_user():
    rng = np.random.default_rng(2)
    true_diff, repeats, users, per_user = 0.25, 200, 100, 10
    # 200 samples of 1000 log events: 10 per user, each user's events scattered through the log.
    event_user = rng.permutation(np.repeat(np.arange(users), per_user))  # [E]
    user_ids = [f"u{u}" for u in event_user]
    # B - A = true + a user effect shared by all the user's events (sd 1) + event noise (sd 0.3).
    effect = rng.normal(0.0, 1.0, (repeats, users))[:, event_user]  # [S, E]
    a = torch.tensor(rng.normal(1.0, 1.0, effect.shape))
    b = a + true_diff + torch.tensor(effect + rng.normal(0.0, 0.3, effect.shape))
    names = [f"sample{i}" for i in range(repeats)]
    config = arms.ReplayConfig(bootstrap=1000)
    diffs = {
        "user": cmp.metric_differences(
            a, b, names, config, torch.Generator().manual_seed(0), cmp.user_index(user_ids)
        ),
        "event": cmp.metric_differences(a, b, names, config, torch.Generator().manual_seed(0)),
    }
    coverage = {
        unit: sum(d["low"] <= true_diff <= d["high"] for d in by.values()) / repeats
        for unit, by in diffs.items()
    }
    assert 0.9 <= coverage["user"] <= 0.99, coverage
    assert coverage["event"] < 0.7, coverage  # ~3x too narrow: misses the truth most times
    width = {
        unit: np.median([d["high"] - d["low"] for d in by.values()]) for unit, by in diffs.items()
    }
    assert width["user"] > 2 * width["event"], width
    for name in names:  # the point estimate is the mean over events either way
        assert diffs["user"][name]["diff"] == pytest.approx(diffs["event"][name]["diff"])


def test_user_bootstrap_with_one_event_per_user_is_the_event_bootstrap():
    rng = np.random.default_rng(3)
    a = torch.tensor(rng.normal(0.0, 1.0, (2, 300)))
    b = a + 0.1 + torch.tensor(rng.normal(0.0, 0.3, (2, 300)))
    users = cmp.user_index([f"u{u}" for u in rng.permutation(300)])  # a split: 300 distinct users
    assert users.tolist() == list(range(300))
    config = arms.ReplayConfig(bootstrap=500)
    d = cmp.metric_differences(a, b, ["m0", "m1"], config, torch.Generator().manual_seed(0), users)
    # The plain event bootstrap: resample events, same seed, same draws.
    rows = torch.cat([a, b, b - a])
    low, high = cmp.interval(
        cmp.bootstrap_means(rows, config.bootstrap, torch.Generator().manual_seed(0)), 0.95
    )
    got_low = torch.tensor(
        [d[m][k] for k in ("a_low", "b_low", "low") for m in ("m0", "m1")], dtype=torch.float64
    )
    got_high = torch.tensor(
        [d[m][k] for k in ("a_high", "b_high", "high") for m in ("m0", "m1")], dtype=torch.float64
    )
    torch.testing.assert_close(got_low, low)
    torch.testing.assert_close(got_high, high)


def test_identical_arms_give_zero_difference_and_full_overlap():
    lists = torch.tensor([[3, 1, 2], [0, 4, -1], [5, 6, 7]])  # [E=3, K=3], one padded row
    metrics = cmp.arm_metrics(lists, torch.tensor([1, 9, 7]))
    a = torch.stack([metrics[n] for n in cmp.metric_names(3)])
    d = cmp.metric_differences(
        a, a.clone(), cmp.metric_names(3), arms.ReplayConfig(bootstrap=100), torch.Generator()
    )
    assert all(v["diff"] == v["low"] == v["high"] == 0 and not v["significant"] for v in d.values())
    assert cmp.overlap_at_k(lists[[0, 2]], lists[[0, 2]]).tolist() == [1.0, 1.0]
    # Pads are no items: two of three real items shared; none shared.
    other = torch.tensor([[2, 9, 3], [8, 4, -1], [1, 2, 0]])
    assert cmp.overlap_at_k(lists, other).tolist() == pytest.approx([2 / 3, 1 / 3, 0.0])
    assert metrics["rank"].tolist() == [2, 0, 3]
    assert metrics["mrr@3"].tolist() == pytest.approx([0.5, 0.0, 1 / 3])


def test_identical_lists_allow_near_exact_ties_to_swap():
    """Lists are identical item for item, or up to float rounding: items 1 and 2 tie within
    1e-4 in row 0 and may swap; in row 1 they are 0.01 apart, so the swap is a different list."""
    scores = torch.tensor([[-1.0, -2.0, -2.00001], [-1.0, -2.0, -2.01]])
    a = arms.ArmRun(torch.tensor([[3, 1, 2], [3, 1, 2]]), scores, torch.zeros(1), torch.zeros(1), 0)
    swapped = torch.tensor([[3, 2, 1], [3, 2, 1]])
    b = arms.ArmRun(swapped, scores.clone(), torch.zeros(1), torch.zeros(1), 0)
    assert cmp.identical_lists(a, b).tolist() == [True, False]
    assert cmp.identical_lists(a, a).tolist() == [True, True]


# --- replay on the tiny checkpoint ---------------------------------------------------------------


def test_beam_and_spec_beam_replay_to_identical_lists(tiny_checkpoint):
    config = arms.ReplayConfig(bootstrap=200, batch_size=5)  # 24 users: 5 batches
    arm_a = arms.parse_arm("decoder=beam,beam_width=12", tiny_checkpoint)
    arm_b = arms.parse_arm("decoder=spec_beam,beam_width=12", tiny_checkpoint, "--b")
    result = rp.run_replay(arm_a, arm_b, config, split="test")
    s = result.summary
    assert torch.equal(result.runs[0].items, result.runs[1].items)
    assert s["overlap"]["identical_lists"] == 1.0 and s["overlap"]["mean_overlap@10"] == 1.0
    for d in s["differences"].values():
        assert d["diff"] == d["low"] == d["high"] == 0.0 and not d["significant"]
    assert s["arms"]["A"]["target_passes_per_batch"] > s["arms"]["B"]["target_passes_per_batch"]
    assert "identical lists for 100.0% of users" in "\n".join(s["verdict"])
    # Arm A's metrics are `genrec-spec evaluate`'s on the same users.
    model, data = load_model_and_data(tiny_checkpoint)
    reference = evaluate(model, data.test, get_decoder("beam"), ks=(10,), beam_width=12)
    assert s["arms"]["A"]["metrics"]["hr@10"] == pytest.approx(reference["hr@10"])
    assert s["arms"]["A"]["metrics"]["mrr@10"] == pytest.approx(reference["mrr"])
    assert s["replay"]["events"] == len(data.test) and s["replay"]["batches"] == 5
    # Every user of the split, counted (the config's user sample, 0 = all, is kept apart).
    assert s["replay"]["users"] == len(data.test) and s["replay"]["user_sample"] == 0
    assert f"replay of {len(data.test)} events of {len(data.test)} users" in s["verdict"][0]


def test_a_time_aware_arm_replays_with_the_events_times(tiny_checkpoint, tmp_path):
    """A time-aware model (the same data) against the plain one: its events carry their items'
    times and the held-out item's as the time of the prediction, so its metrics are `evaluate`'s
    on the data with times; on a log, the log's timestamps join the train items'."""
    from dataclasses import replace

    from genrec_spec.models.recsys.recommender import SemanticIdRecommender

    plain, data = load_model_and_data(tiny_checkpoint)
    config = replace(plain.config, block="hstu", relative_bias=True, time_bias=True)
    torch.manual_seed(3)
    timed = SemanticIdRecommender(
        config, data.item_codes, data.codebook_sizes, data.long_ids, data.long_id_sizes
    ).eval()
    manifest = {"data": {"path": str(data.path), "data_hash": data.data_hash}}
    save_checkpoint(tmp_path / "timed", timed, manifest)
    arm_a = arms.parse_arm("decoder=beam", tiny_checkpoint)
    arm_b = arms.parse_arm("decoder=spec_beam", tmp_path / "timed", "--b")
    replay_config = arms.ReplayConfig(bootstrap=20, batch_size=5)
    s = rp.run_replay(arm_a, arm_b, replay_config, split="test").summary
    reference = evaluate(timed, data.with_times().test, get_decoder("beam"), ks=(10,))
    assert s["arms"]["B"]["metrics"]["hr@10"] == pytest.approx(reference["hr@10"])
    assert s["arms"]["B"]["metrics"]["mrr@10"] == pytest.approx(reference["mrr"])
    _valid_then_test_log(data).to_parquet(tmp_path / "log.parquet", index=False)
    logged = rp.run_replay(arm_a, arm_b, replay_config, log=tmp_path / "log.parquet").summary
    assert logged["replay"]["events"] == 2 * len(data.test)


def test_replay_counts_the_users_of_a_sample_and_of_a_log(tiny_checkpoint, tmp_path):
    arm_a = arms.parse_arm("decoder=beam", tiny_checkpoint)
    arm_b = arms.parse_arm("decoder=heads", tiny_checkpoint, "--b")
    config = arms.ReplayConfig(users=7, bootstrap=20, batch_size=5)
    sample = rp.run_replay(arm_a, arm_b, config, split="test").summary
    assert (sample["replay"]["events"], sample["replay"]["users"]) == (7, 7)
    assert sample["replay"]["user_sample"] == 7
    _, data = load_model_and_data(tiny_checkpoint)
    log = _valid_then_test_log(data)  # two events per user
    log.to_parquet(tmp_path / "log.parquet", index=False)
    config = arms.ReplayConfig(bootstrap=20, batch_size=5)
    logged = rp.run_replay(arm_a, arm_b, config, log=tmp_path / "log.parquet").summary
    assert logged["replay"]["events"] == len(log) == 2 * len(data.test)
    assert logged["replay"]["users"] == log["user_id"].nunique() == len(data.test)
    assert f"of {len(data.test)} users" in logged["verdict"][0]


@pytest.fixture(scope="module")
def second_checkpoint(tiny_checkpoint, tmp_path_factory) -> Path:
    """Another tiny model (other initial weights) on the same data as `tiny_checkpoint`."""
    from genrec_spec.models.recsys.recommender import SemanticIdRecommender

    model, data = load_model_and_data(tiny_checkpoint)
    torch.manual_seed(1)
    other = SemanticIdRecommender(
        model.config, data.item_codes, data.codebook_sizes, data.long_ids, data.long_id_sizes
    )
    manifest = {"data": {"path": str(data.path), "data_hash": data.data_hash}}
    out = tmp_path_factory.mktemp("second") / "ckpt"
    save_checkpoint(out, other, manifest)
    return out


def test_report_files_are_complete_and_self_contained(
    tiny_checkpoint, second_checkpoint, tmp_path, capsys
):
    out = tmp_path / "out"
    argv = ["--ckpt", str(tiny_checkpoint), "--ckpt-b", str(second_checkpoint)]
    argv += ["--a", "decoder=beam", "--b", "decoder=heads"]
    code, printed, _ = _replay([*argv, "--split", "test", "--out", str(out), *FAST], capsys)
    assert code == 0, printed
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["report.html", "metrics.json", "per_user.parquet"]
    )
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temporary folder left
    page = (out / "report.html").read_text()
    images = page.split('src="data:image/png;base64,')[1:]
    assert len(images) == 3
    for image in images:
        assert base64.b64decode(image.split('"')[0]).startswith(b"\x89PNG\r\n\x1a\n")
    text = re.sub(r"data:image/png;base64,[A-Za-z0-9+/=]+", "", page)
    for external in ("http", "//", "<script", "<link", "url("):
        assert external not in text, external  # nothing fetched from elsewhere
    metrics = json.loads((out / "metrics.json").read_text())
    assert set(metrics) == {
        "replay", "arms", "differences", "latency", "overlap", "verdict", "command"
    }  # fmt: skip
    assert set(metrics["differences"]) == {"hr@10", "ndcg@10", "mrr@10"}
    assert {
        "decoder",
        "options",
        "ckpt",
        "metrics",
        "ms_per_event",
        "target_passes_per_batch",
    } <= set(metrics["arms"]["B"])
    assert {"low", "high", "speedup_of_b", "speedup_low", "speedup_high"} <= set(metrics["latency"])
    assert metrics["command"].startswith("genrec-spec replay --ckpt ")
    assert metrics["arms"]["B"]["ckpt"] == str(second_checkpoint)
    assert metrics["overlap"]["identical_lists"] < 1.0
    rows = pd.read_parquet(out / "per_user.parquet")
    assert len(rows) == 24 and rows["user_id"].nunique() == 24
    for column in ("target", "a_rank", "a_hit", "a_ndcg", "a_rr", "b_rank", "b_rr", "overlap"):
        assert column in rows
    assert rows["a_latency_ms"].sum() == pytest.approx(metrics["arms"]["A"]["total_s"] * 1e3)
    assert (rows["a_hit"] == (rows["a_rank"] > 0)).all()
    assert "verdict:" in printed and "B = decoder=heads" in printed


def test_a_failed_replay_leaves_nothing_behind(tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "out"
    # beam_width < k fails inside the replay, after the temporary output folder was made.
    argv = ["--ckpt", str(tiny_checkpoint), "--a", "decoder=beam,beam_width=3", "--b"]
    code, _, err = _replay([*argv, "decoder=beam", "--split", "test", "--out", str(out)], capsys)
    assert code == 2 and "beam_width 3 must be >= k = 10" in err
    assert list(tmp_path.iterdir()) == []
    # An existing result is kept unless --overwrite.
    out.mkdir()
    (out / "keep.txt").write_text("old")
    argv = ["--ckpt", str(tiny_checkpoint), "--a", "decoder=beam", "--b", "decoder=beam"]
    code, _, err = _replay([*argv, "--split", "valid", "--out", str(out)], capsys)
    assert code == 2 and "--overwrite" in err
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_split_events_follow_the_held_out_items_time(tmp_path, tiny_prepared):
    """Events run in the held-out items' time order (the data's times, read off
    interactions.parquet), each history with its items' times; without times, in split order."""
    from genrec_spec.recsys.data import load_prepared

    data = load_prepared(tiny_prepared(tmp_path / "data", users=6))
    # Every user's interactions at time 1 but the last (the test item), whose times run
    # backwards over the users: 100, 99, ...
    test, rows = data.test, []
    for u, user in enumerate(test.user_ids):
        items = test.values[test.offsets[u] : test.offsets[u + 1]].tolist()
        items.append(int(test.targets[u]))
        times = [1] * (len(items) - 1) + [100 - u]
        rows += [(user, data.item_ids[i], t, i) for i, t in zip(items, times, strict=True)]
    columns = ["user_id", "item_id", "timestamp", "item_index"]
    pd.DataFrame(rows, columns=columns).to_parquet(data.path / "interactions.parquet")
    stamps = {user: 100 - u for u, user in enumerate(test.user_ids)}
    events = ev.split_events(data.with_times(), "test", users=4, seed=0)
    assert events.timestamps.tolist() == sorted(events.timestamps.tolist())
    assert events.histories.user_ids == sorted(events.histories.user_ids, key=stamps.get)
    assert len(events.histories) == 4 and events.is_split
    picked = torch.tensor([test.user_ids.index(u) for u in events.histories.user_ids])
    assert torch.equal(events.histories.targets, test.targets[picked])
    assert torch.equal(events.history_lengths, test.lengths[picked])
    assert bool((events.histories.times == 1).all())
    untimed = ev.split_events(data, "test", users=4, seed=0)
    assert untimed.timestamps is None
    assert untimed.histories.user_ids == sorted(untimed.histories.user_ids, key=test.user_ids.index)


# --- log replay ----------------------------------------------------------------------------------


def _valid_then_test_log(data) -> pd.DataFrame:
    """Each user's valid item, then their test item, users interleaved in time."""
    rows = []
    for u, user in enumerate(data.test.user_ids):
        rows.append((user, 100 + u, data.item_ids[int(data.valid.targets[u])]))
        rows.append((user, 1000 + u, data.item_ids[int(data.test.targets[u])]))
    return pd.DataFrame(rows, columns=["user_id", "timestamp", "item_id"]).sample(
        frac=1.0, random_state=0
    )


def test_log_events_append_earlier_log_items_to_the_train_history(tiny_checkpoint, tmp_path):
    _, data = load_model_and_data(tiny_checkpoint)
    log = pd.DataFrame(
        {
            "user_id": ["u1", "u0", "u1", "u1", "u0"],
            "timestamp": [5, 7, 5, 2, 1],  # u1's two events at time 5 keep file order
            "item_id": ["i3", "i4", "i5", "i6", "i7"],
        }
    )
    log.to_csv(tmp_path / "log.csv", index=False)
    events = ev.log_events(data, ev.read_log(tmp_path / "log.csv"), 0, 0, keep_last=100)
    h = events.histories
    assert events.timestamps.tolist() == [1, 2, 5, 5, 7]
    assert h.user_ids == ["u0", "u1", "u1", "u1", "u0"]
    assert h.targets.tolist() == [7, 6, 3, 5, 4]
    train = {u: data.train.select(torch.tensor([u])).values.tolist() for u in (0, 1)}
    got = [h.values[h.offsets[e] : h.offsets[e + 1]].tolist() for e in range(5)]
    assert got == [train[0], train[1], train[1] + [6], train[1] + [6, 3], train[0] + [7]]
    assert events.history_lengths.tolist() == [len(g) for g in got]
    short = ev.log_events(data, ev.read_log(tmp_path / "log.csv"), 0, 0, keep_last=2)
    assert short.histories.values[short.histories.offsets[3] :][:2].tolist() == [6, 3]


def test_log_of_valid_and_test_items_replays_both_splits(tiny_checkpoint, tmp_path, capsys):
    _, data = load_model_and_data(tiny_checkpoint)
    _valid_then_test_log(data).to_parquet(tmp_path / "log.parquet", index=False)
    argv = ["--ckpt", str(tiny_checkpoint), "--a", "decoder=beam", "--b", "decoder=rpg", *FAST]
    code, printed, _ = _replay(
        [*argv, "--log", str(tmp_path / "log.parquet"), "--out", str(tmp_path / "log")], capsys
    )
    assert code == 0 and "identical lists for" in printed and "of events" in printed
    code, _, _ = _replay([*argv, "--split", "test", "--out", str(tmp_path / "split")], capsys)
    assert code == 0
    log_rows = pd.read_parquet(tmp_path / "log" / "per_user.parquet")
    split_rows = pd.read_parquet(tmp_path / "split" / "per_user.parquet")
    assert len(log_rows) == 2 * len(split_rows) and log_rows["timestamp"].is_monotonic_increasing
    tests = log_rows[log_rows["timestamp"] >= 1000].set_index("user_id")
    split_rows = split_rows.set_index("user_id").loc[tests.index]
    for column in ("target", "history_length", "a_rank", "b_rank"):
        assert tests[column].tolist() == split_rows[column].tolist(), column
    for column in ("a_items", "b_items"):
        assert tests[column].map(list).tolist() == split_rows[column].map(list).tolist(), column
    # The log's intervals resample users (two events each), not events.
    metrics = json.loads((tmp_path / "log" / "metrics.json").read_text())
    a, b = (
        torch.tensor(log_rows[[f"{side}_{m}" for m in ("hit", "ndcg", "rr")]].to_numpy().T)
        for side in "ab"
    )
    names, config = cmp.metric_names(10), arms.ReplayConfig(bootstrap=200)
    users = cmp.user_index(log_rows["user_id"].tolist())
    assert int(users.max()) + 1 == len(split_rows) and "intervals over users" in printed
    by_user = cmp.metric_differences(a, b, names, config, torch.Generator().manual_seed(0), users)
    for name in names:
        assert metrics["differences"][name]["low"] == pytest.approx(by_user[name]["low"])
        assert metrics["differences"][name]["high"] == pytest.approx(by_user[name]["high"])


# --- bad input -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def other_data_checkpoint(tiny_checkpoint, tmp_path_factory, tiny_prepared) -> Path:
    """The tiny model saved as trained on another data folder (another data hash)."""
    from genrec_spec.recsys.data import load_prepared

    root = tmp_path_factory.mktemp("other")
    data = load_prepared(tiny_prepared(root / "data", seed=1))
    model, _ = load_model_and_data(tiny_checkpoint)
    manifest = {"data": {"path": str(data.path), "data_hash": data.data_hash}}
    save_checkpoint(root / "ckpt", model, manifest)
    return root / "ckpt"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"--ckpt": "missing"}, "has no manifest.json"),
        ({"--ckpt-b": "OTHER"}, "an A/B replay compares models of the same data"),
        ({"--a": "decoder=beam,beam_width"}, "cannot parse 'beam_width'. Fix: write decoder=NAME["),
        ({"--a": "beam_width=20"}, "names no decoder"),
        ({"--b": "decoder=greedy"}, "valid decoders: beam, spec_beam, heads, rpg, nezha"),
        (
            {"--b": "decoder=heads,beam_width=5"},
            "takes no option 'beam_width'. Fix: use one of its options",
        ),
        # (a word said "invalid literal for int()", 2.5 ran as width 2)
        ({"--a": "decoder=beam,beam_width=wide"}, "takes int or null, got 'wide'"),
        ({"--a": "decoder=beam,beam_width=12.5"}, "takes int or null, got 12.5"),
        ({"--out": "FILE/out"}, "cannot create the output folder"),
        ({"--split": None, "--log": "NOCOLUMN"}, "lacks column(s) ['timestamp']"),
        ({"--split": None, "--log": "UNKNOWN"}, "the log names 1 items the data does not know"),
        ({"--bootstrap": "0"}, "--bootstrap must be >= 1"),
        ({"--k": "100"}, "--k 100 exceeds the catalogue (40 items)"),
    ],
)
def test_bad_input_is_one_clear_line_and_writes_nothing(
    tiny_checkpoint, other_data_checkpoint, tmp_path, capsys, change, message
):
    (tmp_path / "FILE").write_text("a file, not a folder")
    pd.DataFrame({"user_id": ["u0"], "item_id": ["i1"]}).to_csv(tmp_path / "NOCOLUMN.csv")
    unknown = pd.DataFrame({"user_id": ["u0", "u1"], "timestamp": [1, 2], "item_id": ["i1", "x"]})
    unknown.to_csv(tmp_path / "UNKNOWN.csv", index=False)
    paths = {
        "missing": str(tmp_path / "missing"),
        "OTHER": str(other_data_checkpoint),
        "FILE/out": str(tmp_path / "FILE" / "out"),
        "NOCOLUMN": str(tmp_path / "NOCOLUMN.csv"),
        "UNKNOWN": str(tmp_path / "UNKNOWN.csv"),
    }
    args = {"--ckpt": str(tiny_checkpoint), "--a": "decoder=beam", "--b": "decoder=spec_beam"}
    args |= {"--split": "test", "--out": str(tmp_path / "out"), "--bootstrap": "50"}
    args |= {flag: paths.get(value, value) for flag, value in change.items()}
    argv = [word for flag, value in args.items() if value is not None for word in (flag, value)]
    before = sorted(p.name for p in tmp_path.iterdir())
    code, _, err = _replay(argv, capsys)
    assert code == 2
    assert err.count("\n") == 1 and message in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == before
