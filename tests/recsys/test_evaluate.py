"""`genrec-spec evaluate` and `genrec-spec recommend` on a tiny checkpoint: metrics equal a
hand-made check, raw ids in and out, bad input."""

from __future__ import annotations

import argparse
import json
import math
import unicodedata
from types import SimpleNamespace

import pytest
import torch

from genrec_spec.cli import evaluate as evaluate_cli
from genrec_spec.cli import recommend as recommend_cli
from genrec_spec.data_pipelines.trie import PrefixTrie
from genrec_spec.recsys import evaluate as ev
from genrec_spec.recsys.checkpoint import save_checkpoint
from genrec_spec.recsys.data import sample_users
from genrec_spec.recsys.decoders import heads, nezha
from genrec_spec.recsys.decoders.registry import parse_option
from genrec_spec.recsys.errors import DecodeOptionError, RecommendInputError
from genrec_spec.recsys.recommend_user import item_indices, user_history


@pytest.fixture
def tiny_ckpt(tiny_model, tmp_path):
    """(checkpoint folder of the tiny model, model, its PreparedData)."""
    model, data = tiny_model
    manifest = {"data": {"path": str(data.path), "data_hash": data.data_hash}}
    save_checkpoint(tmp_path / "ckpt", model, manifest)
    return tmp_path / "ckpt", model, data


def _args(module, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return parser.parse_args(argv)


def _hand_metrics(lists: list[list[int]], targets: list[int], ks) -> dict[str, float]:
    """HR@K, NDCG@K and MRR written out from their definitions, user by user."""
    sums = {f"{m}@{k}": 0.0 for m in ("hr", "ndcg") for k in ks} | {"mrr": 0.0}
    for items, target in zip(lists, targets, strict=True):
        if target not in items:
            continue
        rank = items.index(target) + 1
        sums["mrr"] += 1 / rank
        for k in ks:
            if rank <= k:
                sums[f"hr@{k}"] += 1
                sums[f"ndcg@{k}"] += 1 / math.log2(rank + 1)
    return {name: value / len(targets) for name, value in sums.items()}


@pytest.mark.parametrize("decode", [heads.decode, nezha.decode])
def test_metrics_equal_a_hand_made_check(tiny_model, decode):
    model, data = tiny_model
    ks = (1, 5, 20)
    result = ev.evaluate(model, data.test, decode, ks=ks, batch_size=5)
    trie = PrefixTrie.from_codes(model.item_codes, tuple(model.codebook_sizes))
    lists = []
    for user in range(len(data.test)):  # one user per call
        one = data.test.select(torch.tensor([user]))
        lists.append(decode(model, one.values, one.offsets, k=20, trie=trie).items[0].tolist())
    hand = _hand_metrics(lists, data.test.targets.tolist(), ks)
    assert result["hr@20"] > 0, "no hit at all: the check would be vacuous"
    for name, value in hand.items():
        assert result[name] == pytest.approx(value, abs=1e-9), name
    assert result["users"] == len(data.test)
    assert result["invalid_items"] == 0
    assert result["target_passes_per_batch"] == 1


def test_exclude_history_ranks_only_items_outside_the_read_history(tiny_model):
    """Each list is the decoder's whole ranking without the history items the model reads (the
    most recent max_len; older ones may return), cut to max(ks)."""
    model, data = tiny_model
    ks, max_len = (1, 5, 10), model.config.max_len
    result = ev.evaluate(model, data.test, heads.decode, ks=ks, batch_size=5, exclude_history=True)
    trie = PrefixTrie.from_codes(model.item_codes, tuple(model.codebook_sizes))
    lists, cut, dropped = [], 0, 0
    for user in range(len(data.test)):
        one = data.test.select(torch.tensor([user]))
        ranking = heads.decode(model, one.values, one.offsets, k=model.num_items, trie=trie)
        seen = set(one.values[-max_len:].tolist())
        lists.append([i for i in ranking.items[0].tolist() if i not in seen][:10])
        cut += len(one.values) > max_len
        dropped += len(seen & set(ranking.items[0, :10].tolist()))
    assert cut > 0, "no history is longer than the context: the window would go untested"
    assert dropped > 0, "no top-10 holds a history item: the check would be vacuous"
    hand = _hand_metrics(lists, data.test.targets.tolist(), ks)
    for name, value in hand.items():
        assert result[name] == pytest.approx(value, abs=1e-9), name
    assert result["invalid_items"] == 0


def test_count_invalid_and_user_subsets():
    items = torch.tensor([[3, 1, -1, -1], [2, 9, 2, 0], [5, 4, 3, 2]])  # 9 outside, 2 repeated
    assert ev.count_invalid(items, num_items=6) == 2
    rows = sample_users(50, 10, seed=1)
    assert torch.equal(rows, sample_users(50, 10, seed=1))
    assert len(rows.unique()) == 10 and bool((rows[1:] > rows[:-1]).all())
    assert torch.equal(sample_users(5, 0, seed=1), torch.arange(5))
    with pytest.raises(ValueError, match="users"):
        sample_users(5, -1, seed=0)


def test_parse_option():
    assert parse_option("beam_width=50") == ("beam_width", 50)
    assert parse_option("x=0.5") == ("x", 0.5)
    assert parse_option("lookahead=false") == ("lookahead", False)
    assert parse_option(" draft = none ") == ("draft", "none")  # a string, not None
    with pytest.raises(DecodeOptionError, match="NAME=VALUE"):
        parse_option("beam_width")
    with pytest.raises(argparse.ArgumentTypeError, match="NAME=VALUE"):  # --option's parse
        evaluate_cli.option_argument("beam_width")


def test_evaluate_command(tiny_ckpt, tmp_path, capsys):
    ckpt, model, data = tiny_ckpt
    out = tmp_path / "eval.json"
    argv = ["--ckpt", str(ckpt), "--split", "valid", "--decoder", "heads,rpg", "--k", "5,10"]
    argv += ["--users", "10", "--batch-size", "4", "--option", "mode=exact", "--json", str(out)]
    assert evaluate_cli.run(_args(evaluate_cli, argv)) == 0
    table = capsys.readouterr().out
    assert "heads" in table and "rpg" in table and "ndcg@10" in table
    report = json.loads(out.read_text())
    assert report["users"] == 10 and report["options"] == {"mode": "exact"}
    rows = sample_users(len(data.valid), 10, seed=0)
    expected = ev.evaluate(model, data.valid.select(rows), heads.decode, ks=(5, 10))
    for name in ("hr@5", "ndcg@10", "mrr"):
        assert report["results"]["heads"][name] == pytest.approx(expected[name])


def test_evaluate_bad_input(tiny_ckpt, tiny_prepared, tmp_path):
    ckpt, model, data = tiny_ckpt
    with pytest.raises(ValueError, match="no listed decoder takes"):
        evaluate_cli.run(
            _args(evaluate_cli, ["--ckpt", str(ckpt), "--decoder", "heads", "--option", "beam=3"])
        )
    # a value the decoder cannot take: refused before the model loads, not truncated (2.5 -> 2)
    for value, says in (("2.5", "got 2.5"), ("wide", "got 'wide'")):
        argv = ["--ckpt", str(ckpt), "--decoder", "beam", "--option", f"beam_width={value}"]
        with pytest.raises(ValueError, match=f"takes int or null, {says}"):
            evaluate_cli.run(_args(evaluate_cli, argv))
    with pytest.raises(ValueError, match="takes a tensor, got 3"):  # NAME=VALUE cannot carry one
        argv = ["--ckpt", str(ckpt), "--decoder", "spec_beam", "--option", "draft_items=3"]
        evaluate_cli.run(_args(evaluate_cli, argv))
    other = tiny_prepared(tmp_path / "other", seed=1)
    with pytest.raises(ValueError, match="trained on data"):
        evaluate_cli.run(_args(evaluate_cli, ["--ckpt", str(ckpt), "--data", str(other)]))
    with pytest.raises(ValueError, match="targets"):
        ev.evaluate(model, data.train, heads.decode)
    for bad in (["--k", "0"], ["--k", "a,b"], ["--option", "novalue"], ["--decoder", " , "]):
        with pytest.raises(SystemExit):
            _args(evaluate_cli, ["--ckpt", str(ckpt), *bad])


def test_recommend_command(tiny_ckpt, capsys):
    ckpt, model, data = tiny_ckpt
    user = data.test.user_ids[2]
    argv = ["--ckpt", str(ckpt), "--user", user, "--k", "4", "--decoder", "nezha", "--json"]
    assert recommend_cli.run(_args(recommend_cli, argv)) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["user_id"] == user and len(answer["items"]) == 4
    ids = [entry["item_id"] for entry in answer["items"]]
    assert len(set(ids)) == 4 and set(ids) <= set(data.item_ids)
    # --user reads the whole known history: the same answer as giving it by hand.
    history = user_history(data, user)
    assert history[-1] == int(data.test.targets[2])
    raw = ",".join(data.item_ids[i] for i in history)
    argv = ["--ckpt", str(ckpt), "--history", raw, "--k", "4", "--decoder", "nezha", "--json"]
    recommend_cli.run(_args(recommend_cli, argv))
    assert json.loads(capsys.readouterr().out)["items"] == answer["items"]
    # ... and as a JSON list, the form for ids holding commas (MovieLens titles)
    argv[argv.index(raw)] = json.dumps([data.item_ids[i] for i in history])
    recommend_cli.run(_args(recommend_cli, argv))
    assert json.loads(capsys.readouterr().out)["items"] == answer["items"]
    # --exclude-seen leaves the history's items out (without it the list holds some).
    seen = {data.item_ids[i] for i in history}
    argv = ["--ckpt", str(ckpt), "--user", user, "--k", "20", "--decoder", "nezha", "--json"]
    recommend_cli.run(_args(recommend_cli, argv))
    assert seen & {entry["item_id"] for entry in json.loads(capsys.readouterr().out)["items"]}
    recommend_cli.run(_args(recommend_cli, [*argv, "--exclude-seen"]))
    unseen = json.loads(capsys.readouterr().out)
    assert unseen["exclude_seen"] and len(unseen["items"]) == 20
    assert not seen & {entry["item_id"] for entry in unseen["items"]}
    # Cold start and a history past the context are answered, and said so.
    recommend_cli.run(_args(recommend_cli, ["--ckpt", str(ckpt), "--history", "", "--json"]))
    assert json.loads(capsys.readouterr().out)["cold_start"]
    long = ",".join(data.item_ids[i % model.num_items] for i in range(model.config.max_len + 5))
    recommend_cli.run(_args(recommend_cli, ["--ckpt", str(ckpt), "--history", long]))
    assert f"most recent {model.config.max_len} items" in capsys.readouterr().out


def test_ids_in_another_unicode_form_are_found():
    # MovieLens-1M's ids are titles, 47 with accents; typed, an "é" may come as "e" + U+0301
    data = SimpleNamespace(item_ids=["Misérables, Les (1995)", "Heat (1995)"])
    typed = unicodedata.normalize("NFD", data.item_ids[0])
    assert typed != data.item_ids[0]
    assert item_indices(data, [typed, "Heat (1995)"]) == [0, 1]


def test_recommend_bad_ids(tiny_ckpt):
    ckpt, _, _ = tiny_ckpt
    with pytest.raises(ValueError, match="unknown user id 'nobody'"):
        recommend_cli.run(_args(recommend_cli, ["--ckpt", str(ckpt), "--user", "nobody"]))
    with pytest.raises(ValueError, match="unknown item id.*zz9"):
        recommend_cli.run(_args(recommend_cli, ["--ckpt", str(ckpt), "--history", "i1,zz9"]))
    # A list that is not JSON, or not of ids: refused with the CLI's prefix and a fix (exit 2)
    for bad, problem in (('["i1", ', "is not JSON"), ('[{"i": 1}]', "not a list of item ids")):
        with pytest.raises(RecommendInputError, match=f"{problem}.*Fix: pass a"):
            recommend_cli.run(_args(recommend_cli, ["--ckpt", str(ckpt), "--history", bad]))
    with pytest.raises(RecommendInputError, match="not a list of integers"):
        argv = ["--ckpt", str(ckpt), "--history", "i1", "--history-times", "noon"]
        recommend_cli.run(_args(recommend_cli, argv))
    with pytest.raises(SystemExit):  # --user and --history are exclusive
        _args(recommend_cli, ["--ckpt", str(ckpt), "--user", "u1", "--history", "i1"])
