"""HSTU's time-aware relative bias (`RecommenderConfig.time_bias`, `models.recsys.times`): the
buckets and token times against their definitions, training against inference, batching and
truncation, and the errors of a model given the wrong times."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from genrec_spec.models.recsys.config import ConfigError, RecommenderConfig
from genrec_spec.models.recsys.layout import train_layout
from genrec_spec.models.recsys.recommender import (
    HistoryTimes,
    RecommenderInputError,
    SemanticIdRecommender,
)
from genrec_spec.models.recsys.times import time_buckets, token_times
from genrec_spec.recsys.errors import RecommendInputError
from genrec_spec.recsys.history_cache import HistoryCache


@pytest.fixture
def timed_model(tiny_model):
    """The tiny model's config with HSTU blocks and their position and time biases, drawn far
    from their small initial values so that a wrong distance or time bucket anywhere shows."""
    plain, data = tiny_model
    config = replace(plain.config, block="hstu", relative_bias=True, time_bias=True)
    torch.manual_seed(0)
    model = SemanticIdRecommender(
        config, data.item_codes, data.codebook_sizes, data.long_ids, data.long_id_sizes
    )
    for block in model.blocks:
        block.relative_bias.data.normal_()
        block.time_bias.data.normal_()
    return model.eval()


def _times(lengths: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(item times [M], query times [B]): each row's times rise by gaps from 0 s to years, the
    query after its row's last item."""
    g = torch.Generator().manual_seed(seed)
    values, query = [], []
    for n in lengths:
        gaps = (10 ** (torch.rand(n + 1, generator=g) * 8)).long()
        gaps[torch.rand(n + 1, generator=g) < 0.2] = 0  # equal timestamps happen
        row = 9e8 + gaps.cumsum(0)
        values.append(row[:n].long())
        query.append(row[n].long())
    return torch.cat(values), torch.stack(query)


def test_time_buckets_are_hstus():
    """floor(ln(max(|gap|, 1)) / 0.301), clamped to 0..128."""
    gaps = torch.tensor([0, 1, 2, 3, 59, 3600, 86400 * 365, -3600, 10**10, 2**62])
    want = [min(128, int(math.log(max(abs(g), 1)) / 0.301)) for g in gaps.tolist()]
    assert time_buckets(gaps).tolist() == want


def test_token_times_follow_the_definition():
    """Token t shows x_{t-1} (BOS the first item) and predicts x_t (the last token the query
    time); an empty history's BOS holds the query time; padding holds it too."""
    times = HistoryTimes(torch.tensor([10, 20, 30, 5]), torch.tensor([40, 7, 99]))
    offsets = torch.tensor([0, 3, 4, 4])  # rows of 3, 1 and 0 items
    key, query = token_times(times, offsets, 4)
    assert key.tolist() == [[10, 10, 20, 30], [5, 5, 7, 7], [99, 99, 99, 99]]
    assert query.tolist() == [[10, 20, 30, 40], [5, 7, 7, 7], [99, 99, 99, 99]]


def test_training_with_times_matches_inference(timed_model, random_histories):
    """forward_train's losses over windows with timestamps equal encode_history on every prefix
    (queried at the time of the item it predicts) and score_tree on every branch."""
    model = timed_model
    g = torch.Generator().manual_seed(3)
    windows, offsets = random_histories(model, [6, 13, 1], seed=4)
    window_times, _ = _times([6, 13, 1], seed=5)
    layout = train_layout(windows, offsets, model.num_levels - 1, 3, g, window_times)
    losses = model.forward_train(layout)

    terms = {level: [] for level in range(model.num_levels)}
    for b in range(3):
        seq, seq_times = (t[offsets[b] : offsets[b + 1]] for t in (windows, window_times))
        for t in range(len(seq)):
            times = HistoryTimes(seq_times[:t], seq_times[t : t + 1])
            state = model.encode_history(seq[:t], torch.tensor([0, t]), times)
            target = model.item_codes[seq[t]]
            terms[0].append(-state.level0_log_probs[0, target[0]])
            if t in layout.branch_anchor[b].tolist():
                chain = torch.arange(model.num_levels - 1)
                out = model.score_tree(state, target[None, :-1], chain[None], chain[None] - 1)
                for level in range(1, model.num_levels):
                    terms[level].append(-out[0, level - 1, target[level]])
    for level, per_term in terms.items():
        expected = torch.stack(per_term).mean()
        torch.testing.assert_close(losses[f"level_{level}"], expected, atol=1e-5, rtol=1e-5)


def test_batched_and_truncated_histories_equal_one_at_a_time(timed_model, uneven_histories):
    """A batch of uneven rows (an empty one, ones longer than max_len) gives each row what it
    gives alone, and a cut row what its most recent max_len items with their times give; the
    fused history + tree pass equals encode_history then score_tree."""
    model = timed_model
    values, offsets = uneven_histories(model, 5, seed=1)
    lengths = (offsets[1:] - offsets[:-1]).tolist()
    item_times, query = _times(lengths, seed=2)
    times = HistoryTimes(item_times, query)
    codes = torch.tensor([[1, 0, 2]] * 5)  # a level-0 node, its child, another level-0 node
    levels, parents = torch.tensor([[0, 1, 0]] * 5), torch.tensor([[-1, 0, -1]] * 5)
    state, fused = model.encode_history_and_tree(values, offsets, codes, levels, parents, times)
    torch.testing.assert_close(fused, model.score_tree(state, codes, levels, parents))
    for b, n in enumerate(lengths):
        start, keep = int(offsets[b]), min(n, model.config.max_len)
        rows = slice(start + n - keep, start + n)  # the most recent max_len items
        alone = HistoryTimes(item_times[rows], query[b : b + 1])
        one, tree = model.encode_history_and_tree(
            values[rows], torch.tensor([0, keep]), codes[:1], levels[:1], parents[:1], alone
        )
        torch.testing.assert_close(state.level0_log_probs[b], one.level0_log_probs[0])
        torch.testing.assert_close(fused[b], tree[0])


def test_the_model_reads_the_times(timed_model, random_histories):
    """Moving the query time or one item's time changes the next item's distribution; a model
    without a time bias (the same weights otherwise) reads no times."""
    model = timed_model
    values, offsets = random_histories(model, [8], seed=6)
    item_times, query = _times([8], seed=7)
    base = model.encode_history(values, offsets, HistoryTimes(item_times, query))
    later = model.encode_history(values, offsets, HistoryTimes(item_times, query + 10**7))
    moved = item_times.clone()
    moved[:4] -= 10**7
    earlier = model.encode_history(values, offsets, HistoryTimes(moved, query))
    for other in (later, earlier):
        gap = (base.level0_log_probs - other.level0_log_probs).abs().max()
        assert gap > 1e-3


def test_wrong_times_are_refused(timed_model, tiny_model, random_histories):
    """A time-aware model refuses histories without times or with times of the wrong shape, and
    cannot extend a cached history nor be cached; a model without a time bias ignores times;
    the config needs the position bias under the time bias."""
    values, offsets = random_histories(timed_model, [3, 2], seed=8)
    item_times, query = _times([3, 2], seed=9)
    with pytest.raises(RecommenderInputError, match="reads timestamps"):
        timed_model.encode_history(values, offsets)
    with pytest.raises(RecommenderInputError, match="one timestamp per history item"):
        timed_model.encode_history(values, offsets, HistoryTimes(item_times[:-1], query))
    with pytest.raises(RecommenderInputError, match="one timestamp per history item"):
        timed_model.encode_history(values, offsets, HistoryTimes(item_times, query[:1]))
    state = timed_model.encode_history(values, offsets, HistoryTimes(item_times, query))
    with pytest.raises(RecommenderInputError, match="encode the whole history afresh"):
        timed_model.extend_history(state, values[:2], torch.tensor([0, 1, 2]))
    with pytest.raises(RecommendInputError, match="without a history cache"):
        HistoryCache(timed_model)
    plain, _ = tiny_model  # reads no times: ignores them
    with_times = plain.encode_history(values, offsets, HistoryTimes(item_times, query))
    torch.testing.assert_close(
        with_times.level0_log_probs, plain.encode_history(values, offsets).level0_log_probs
    )
    with pytest.raises(ConfigError, match="relative_bias to true"):
        RecommenderConfig(block="hstu", time_bias=True)


def test_every_decoder_reads_times_and_spec_beam_is_beam(timed_model, tiny_data_dir):
    """Every decoder runs on a time-aware model given the test split's times (the targets' as
    the query times), on either engine; spec_beam's lists are beam's; without times each
    decoder is refused; candidate scoring gives beam's scores."""
    from genrec_spec.recsys.data import load_prepared
    from genrec_spec.recsys.decoders.registry import DECODERS
    from genrec_spec.recsys.recommend import recommend
    from genrec_spec.recsys.scoring import score

    test = load_prepared(tiny_data_dir).with_times().test
    histories, times = (test.values, test.offsets), test.history_times()
    lists = {}
    for decoder in DECODERS:
        engines = ("native", "core") if decoder in ("beam", "spec_beam") else ("native",)
        for engine in engines:
            options = {"engine": engine} if len(engines) > 1 else {}
            out = recommend(timed_model, histories, 5, decoder, times=times, **options)
            assert out.items.shape == (len(test), 5) and bool((out.items >= 0).all())
            lists[decoder, engine] = out.items
        with pytest.raises(RecommenderInputError, match="reads timestamps"):
            recommend(timed_model, histories, 5, decoder)
    for engine in ("native", "core"):
        assert torch.equal(lists["spec_beam", engine], lists["beam", "native"])
    assert torch.equal(lists["beam", "core"], lists["beam", "native"])
    # candidate scoring reads the times too: beam's scores are its items' log-likelihoods
    out = recommend(timed_model, histories, 5, "beam", times=times)
    scored = score(timed_model, *histories, out.items, times=times)
    torch.testing.assert_close(scored, out.scores, atol=1e-5, rtol=1e-5)


def test_bench_recsys_times_a_time_aware_model(timed_model, tiny_data_dir, tmp_path):
    """`bench recsys --quick` on a time-aware checkpoint: its data loads with the times, every
    decoder and floor reads them, and the lossless decoders give beam's lists."""
    import argparse
    import json

    from genrec_spec.bench import recsys as bench_recsys
    from genrec_spec.cli import bench_recsys as bench_cli
    from genrec_spec.recsys.checkpoint import save_checkpoint
    from genrec_spec.recsys.data import load_prepared
    from genrec_spec.recsys.decoders.registry import DECODERS

    data = load_prepared(tiny_data_dir)
    manifest = {"data": {"path": str(data.path), "data_hash": data.data_hash}}
    save_checkpoint(tmp_path / "ckpt", timed_model, manifest)
    parser = argparse.ArgumentParser()
    bench_cli.add_arguments(parser)
    argv = ["--ckpt", str(tmp_path / "ckpt"), "--quick", "--k", "3", "--beam-width", "4"]
    assert bench_cli.run(parser.parse_args([*argv, "--json", str(tmp_path / "b.json")])) == 0
    rows = {row["decoder"]: row for row in json.loads((tmp_path / "b.json").read_text())["rows"]}
    lossless = [n for n in rows if DECODERS[bench_recsys.decoder_of(n)].lossless]
    for name in lossless:
        assert rows[name]["same_as_beam"] == 1.0


def test_recommend_command_reads_a_users_times_or_the_given_ones(tiny_checkpoint_writer, tmp_path):
    """`genrec-spec recommend` on a time-aware checkpoint: a known user's times come from the
    data, a history's from --history-times (required), both at the last timestamp by default."""
    from genrec_spec.cli import main
    from genrec_spec.recsys.checkpoint import load_model_and_data
    from genrec_spec.recsys.recommend_user import recommend_for, user_history, user_times

    changes = {"block": "hstu", "relative_bias": True, "time_bias": True}
    ckpt = tiny_checkpoint_writer(tmp_path / "timed", **changes)
    by_user = recommend_for(ckpt, None, user_id="u1", k=4)
    _, data = load_model_and_data(ckpt)
    ids = [data.item_ids[i] for i in user_history(data, "u1")]
    times = user_times(data, "u1")
    by_history = recommend_for(ckpt, None, history_ids=ids, history_times=times, k=4)
    assert by_history["items"] == by_user["items"]
    at = times[-1] + 10**8  # three years on: other time buckets, other scores
    later = recommend_for(ckpt, None, history_ids=ids, history_times=times, at=at, k=4)
    assert later["items"] != by_user["items"]
    with pytest.raises(RecommendInputError, match="--history-times"):
        recommend_for(ckpt, None, history_ids=ids, k=4)
    argv = ["recommend", "--ckpt", str(ckpt), "--history", ",".join(ids), "--k", "2"]
    assert main([*argv, "--history-times", ",".join(map(str, times)), "--json"]) == 0
