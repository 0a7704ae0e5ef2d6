"""`genrec-spec bench recsys --quick` on a tiny checkpoint: every decoder timed on the same users,
beam as the baseline, spec_beam identical to it."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import pytest
import torch

from genrec_spec.bench import recsys as bench_recsys
from genrec_spec.cli import bench_recsys as bench_cli
from genrec_spec.models.recsys.config import TiedLevelsConfig
from genrec_spec.models.recsys.recommender import SemanticIdRecommender
from genrec_spec.recsys.checkpoint import save_checkpoint
from genrec_spec.recsys.decoders import beam
from genrec_spec.recsys.decoders.registry import DECODERS
from genrec_spec.recsys.item_trie import item_trie
from genrec_spec.recsys.scoring import TrieIndex


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_cli.add_arguments(parser)
    return parser.parse_args(argv)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_bench_recsys_quick(block_model, tmp_path, capsys, device):
    """Every decoder, on either kind of block (`block_model`) and device."""
    model, data = block_model
    save_checkpoint(
        tmp_path / "ckpt", model, {"data": {"path": str(data.path), "data_hash": data.data_hash}}
    )
    out = tmp_path / "bench.json"
    argv = ["--ckpt", str(tmp_path / "ckpt"), "--quick", "--k", "3", "--beam-width", "4"]
    argv += ["--device", device]
    assert bench_cli.run(_args(argv + ["--json", str(out)])) == 0
    table = capsys.readouterr().out
    report = json.loads(out.read_text())
    rows = {row["decoder"]: row for row in report["rows"]}
    assert list(rows) == list(bench_recsys.ROWS)  # beam first, then every decoder
    for name in rows:
        assert name in table
    settings = report["settings"]
    assert settings["users"] == 4 and settings["batch_sizes"] == [3]
    assert rows["beam"]["speedup"] == 1.0 and rows["beam"]["same_as_beam"] == 1.0
    assert rows["beam"]["passes"] == model.num_levels
    lossless = [n for n in rows if DECODERS[bench_recsys.decoder_of(n)].lossless]
    assert {"spec-frontier", "spec-heads", "spec-nezha", "beam-native", "spec-native"} < set(
        lossless
    )
    for name in lossless:
        assert rows[name]["same_as_beam"] == 1.0  # lossless: beam's exact top-K
    for name in ("heads", "rpg", "rpg-graph", "nezha", "dense"):
        assert rows[name]["passes"] == 1
    assert rows["beam"]["nodes"] > 0 and rows["heads"]["nodes"] == 0
    assert 0 <= rows["spec_beam"]["hit_rate"] <= 1  # only drafting decoders report one
    assert rows["beam"]["hit_rate"] is None and rows["nezha"]["hit_rate"] is None
    for row in rows.values():
        assert row["p99_ms"] >= row["p50_ms"] > 0 and row["cpu_p50_ms"] > 0
        assert row["users_per_s"]["3"] > 0 and 0 <= row["overlap"] <= 1
    floors = report["floors"]
    assert floors["history_ms"] > 0 and floors["exact_ms"] > 0
    assert 0 < floors["exact_nodes"] <= (model.num_levels - 1) * 4  # at most W a level
    assert "history pass alone" in table and "exact floor" in table


@pytest.mark.parametrize("tied", [False, True])
def test_exact_floor_holds_what_beam_needs(tiny_model, tied):
    """The exact floor's one pass scores every prefix beam's selection reads: beam's selection
    replayed on its log-probs alone (log-prob 0 where the next code is forced and the model's
    forced codes are free: tied levels) gives beam's top-K, so no exact decoder can do less
    target work."""
    model, data = tiny_model
    if tied:
        objective = replace(
            model.config.item_objective, level0=True, tied_levels=TiedLevelsConfig(residual=False)
        )
        config = replace(model.config, item_objective=objective)
        model = SemanticIdRecommender(config, data.item_codes, data.codebook_sizes).eval()
    assert model.forced_codes_free == tied
    trie, width, k = item_trie(model), 4, 3
    to_score = TrieIndex.of(trie).to_score(model)
    users = data.test.select(torch.arange(5))
    tree = bench_recsys.needed_prefixes(model, users, trie, width)
    with torch.no_grad():
        state, log_probs = model.encode_history_and_tree(
            users.values, users.offsets, tree.codes, tree.levels, tree.parents
        )
    rows = torch.arange(5)[:, None]
    beams = beam.extend(beam.start_beams(5, trie), state.level0_log_probs[:, None], trie, 0, width)
    for level in range(1, model.num_levels):
        slot = tree.slot_of(beams.nodes)  # [B, W] -1: not in the tree
        need = (beams.nodes >= 0) & to_score[beams.nodes.clamp(min=0)]
        assert bool((slot[need] >= 0).all())  # every beam with a code to score was scored
        step = log_probs[rows, slot.clamp(min=0)].masked_fill(~need[..., None], 0.0)
        beams = beam.extend(beams, step, trie, level, width)
    items, scores = beam.finish(beams, trie, k)
    want = beam.decode(model, users.values, users.offsets, k=k, trie=trie, beam_width=width)
    assert torch.equal(items, want.items)
    torch.testing.assert_close(scores, want.scores)


def test_bench_recsys_default_beam_width_is_beams(tiny_model, tmp_path, capsys):
    """Without --beam-width every decoder gets beam's own default, max(k, 20)."""
    model, data = tiny_model
    save_checkpoint(
        tmp_path / "ckpt", model, {"data": {"path": str(data.path), "data_hash": data.data_hash}}
    )
    argv = ["--ckpt", str(tmp_path / "ckpt"), "--quick", "--k", "25", "--decoders", "beam,nezha"]
    assert bench_cli.run(_args(argv)) == 0
    assert "K=25, beam width 25," in capsys.readouterr().out


def test_bench_recsys_bad_settings(tmp_path):
    base = ["--ckpt", str(tmp_path)]
    for bad in (["--decoders", "beam,fast"], ["--k", "5", "--beam-width", "4"], ["--users", "0"]):
        with pytest.raises(ValueError):
            bench_cli.settings_from(_args(base + bad))


def test_bench_recsys_returning_users(tiny_model, tmp_path, capsys):
    """--history-cache: the decoders read cached histories and still agree with beam's lists
    (spec_beam exactly); the report says how many histories were extended."""
    model, data = tiny_model
    save_checkpoint(
        tmp_path / "ckpt", model, {"data": {"path": str(data.path), "data_hash": data.data_hash}}
    )
    out = tmp_path / "bench.json"
    argv = ["--ckpt", str(tmp_path / "ckpt"), "--quick", "--k", "3", "--history-cache"]
    argv += ["--decoders", "beam,spec_beam,heads", "--json", str(out)]
    assert bench_cli.run(_args(argv)) == 0
    text = capsys.readouterr().out
    assert "returning users through a history cache:" in text and "extended by their newest" in text
    rows = {row["decoder"]: row for row in json.loads(out.read_text())["rows"]}
    assert rows["spec_beam"]["same_as_beam"] == 1.0 and rows["heads"]["passes"] == 1
