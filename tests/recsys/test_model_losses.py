"""The recommender's training losses against their definitions: the training layout equals the
inference path, the item objective is the next item's cross-entropy, the heads learn from every
n-th position, level 0 from the item objective is the item softmax's marginal."""

from __future__ import annotations

import pytest
import torch

from genrec_spec.models.recsys.config import (
    CodeHeadsConfig,
    ConfigError,
    ItemObjectiveConfig,
    TiedLevelsConfig,
)
from genrec_spec.models.recsys.layout import train_layout


@pytest.mark.parametrize("tied", [False, True])
def test_training_layout_matches_inference(block_model, tied, random_histories, with_objective):
    """forward_train's losses (attention over the training tree) equal the same cross-entropies
    computed with encode_history on every prefix and score_tree on every branch (with the
    code levels tied to the item objective too), under either kind of block."""

    from genrec_spec.models.recsys.recommender import SemanticIdRecommender

    model, data = block_model
    if tied:
        config = with_objective(model.config, level0=True, tied_levels=TiedLevelsConfig(False))
        torch.manual_seed(2)
        model = SemanticIdRecommender(config, data.item_codes, data.codebook_sizes).eval()
    g = torch.Generator().manual_seed(3)
    windows, offsets = random_histories(model, [6, 13, 1], seed=4)
    layout = train_layout(windows, offsets, model.num_levels - 1, 3, g)
    losses = model.forward_train(layout)

    level_terms = {level: [] for level in range(model.num_levels)}
    for b in range(3):
        seq = windows[offsets[b] : offsets[b + 1]]
        for t in range(len(seq)):
            state = model.encode_history(seq[:t], torch.tensor([0, t]))
            target = model.item_codes[seq[t]]
            if not tied:  # else level 0 has no loss of its own
                level_terms[0].append(-state.level0_log_probs[0, target[0]])
            if t in layout.branch_anchor[b].tolist():
                chain = torch.arange(model.num_levels - 1)
                out = model.score_tree(state, target[None, :-1], chain[None], chain[None] - 1)
                for level in range(1, model.num_levels):
                    level_terms[level].append(-out[0, level - 1, target[level]])
    for level, terms in level_terms.items():
        if not terms:
            assert f"level_{level}" not in losses
            continue
        expected = torch.stack(terms).mean()
        torch.testing.assert_close(losses[f"level_{level}"], expected, atol=1e-5, rtol=1e-5)


def _position_states(model, windows, offsets):
    """(history state [1, D], next item) at every position of every window, users in order:
    what forward_train's per-position losses read, encoded one prefix at a time."""
    for b in range(len(offsets) - 1):
        seq = windows[offsets[b] : offsets[b + 1]]
        for t in range(len(seq)):
            yield model.encode_history(seq[:t], torch.tensor([0, t])).hidden, seq[t]


def test_item_objective_is_the_next_item_cross_entropy(
    tiny_model, random_histories, with_objective
):
    """The item objective adds SASRec's loss: the cross-entropy of the next item over the
    catalogue from each history state (encode_history's hidden state . the item table), weighted
    into the total; its output table is the item embedding table, so the model has one even with
    item_embedding false, and a weight of 0 is refused (a null objective turns it off)."""
    from dataclasses import replace

    from genrec_spec.models.recsys.recommender import SemanticIdRecommender

    base, data = tiny_model
    config = with_objective(base.config, weight=0.5)
    model = SemanticIdRecommender(config, data.item_codes, data.codebook_sizes).eval()
    windows, offsets = random_histories(model, [6, 13, 1], seed=4)
    layout = train_layout(windows, offsets, model.num_levels - 1, 3, torch.Generator())
    losses = model.forward_train(layout)
    terms = [
        -model.item_scores(hidden).log_softmax(dim=-1)[0, item]
        for hidden, item in _position_states(model, windows, offsets)
    ]
    torch.testing.assert_close(losses["item"], torch.stack(terms).mean(), atol=1e-5, rtol=1e-5)
    others = sum(v for name, v in losses.items() if name not in ("item", "loss"))
    torch.testing.assert_close(losses["loss"], others + 0.5 * losses["item"])
    torch.manual_seed(0)
    a = SemanticIdRecommender(config, data.item_codes, data.codebook_sizes).state_dict()
    torch.manual_seed(0)
    no_flag = replace(config, item_embedding=False)
    b = SemanticIdRecommender(no_flag, data.item_codes, data.codebook_sizes).state_dict()
    assert "embeddings.embeddings.t_item.weight" in b
    assert all(torch.equal(a[k], b[k]) for k in a) and set(a) == set(b)
    with pytest.raises(ConfigError, match="weight 0.0 must be > 0"):
        ItemObjectiveConfig(weight=0.0)


@pytest.mark.parametrize("stride", [1, 2])
def test_heads_learn_from_every_nth_history_position(tiny_model, stride, random_histories):
    """position_stride n: the parallel and long-ID heads' catalogue losses are the mean,
    over every n-th history position (users in order, positions in order), of the cross-entropy
    of the next item under their summed code log-probs at that position's history state."""
    from dataclasses import replace

    from genrec_spec.models.recsys.recommender import SemanticIdRecommender

    base, data = tiny_model
    heads = CodeHeadsConfig(item_loss=True, position_stride=stride)
    config = replace(base.config, parallel_heads=heads, long_id_heads=heads)
    model = SemanticIdRecommender(
        config, data.item_codes, data.codebook_sizes, data.long_ids, data.long_id_sizes
    ).eval()
    windows, offsets = random_histories(model, [6, 13, 1], seed=4)
    layout = train_layout(windows, offsets, model.num_levels - 1, 3, torch.Generator())
    losses = model.forward_train(layout)
    heads = (("parallel", model.parallel_heads, model.item_codes),)
    heads += (("long_id", model.long_id_heads, model.long_ids),)
    for name, head, table in heads:
        terms = [
            -head.score_items(hidden, table).log_softmax(dim=-1)[0, item]
            for hidden, item in _position_states(model, windows, offsets)
        ]
        want = torch.stack(terms[::stride]).mean()
        torch.testing.assert_close(losses[name], want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ConfigError, match="position_stride -1"):
        CodeHeadsConfig(position_stride=-1)


def test_level0_from_items_is_the_item_softmax_marginal(
    tiny_model, tmp_path, random_histories, with_objective
):
    """The item objective's level0: level 0's log-probs are the item objective's log-probs
    summed over each level-0 cluster (a code no item has: -inf), trained through the item
    objective alone (no level-0 loss of its own), with finite gradients; it survives a
    checkpoint."""

    from genrec_spec.models.recsys.recommender import SemanticIdRecommender
    from genrec_spec.recsys.checkpoint import load_checkpoint, save_checkpoint

    base, data = tiny_model
    config = with_objective(base.config, level0=True)
    sizes = [data.codebook_sizes[0] + 2, *data.codebook_sizes[1:]]  # two level-0 codes unused
    torch.manual_seed(1)
    model = SemanticIdRecommender(config, data.item_codes, sizes).eval()
    windows, offsets = random_histories(model, [6, 13, 1], seed=4)
    state = model.encode_history(windows, offsets)
    item_lp = model.item_scores(state.hidden).log_softmax(dim=-1)  # [B, I]
    clusters = model.item_codes[:, 0]
    expected = torch.stack(
        [item_lp[:, clusters == c].logsumexp(dim=-1) for c in range(sizes[0])], dim=-1
    )
    torch.testing.assert_close(state.level0_log_probs, expected)
    assert torch.isneginf(state.level0_log_probs[:, -2:]).all()

    layout = train_layout(windows, offsets, model.num_levels - 1, 3, torch.Generator())
    losses = model.train().forward_train(layout)
    model.eval()
    assert "level_0" not in losses and "level_1" in losses
    losses["loss"].backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)

    save_checkpoint(tmp_path / "ckpt", model, {})
    loaded = load_checkpoint(tmp_path / "ckpt")[0]
    torch.testing.assert_close(
        loaded.encode_history(windows, offsets).level0_log_probs, state.level0_log_probs
    )


def test_bf16_autocast_losses_follow_fp32(block_model, random_histories):
    """`train.precision` "bf16" runs the training forward under bfloat16 autocast: every loss
    within 1% of fp32's on the same batch (bf16 keeps ~3 significant digits), and the
    heads' sparse incidence products (no bf16 CPU kernel) run in fp32 inside it."""
    model, _ = block_model
    g = torch.Generator().manual_seed(3)
    windows, offsets = random_histories(model, [6, 13, 1, 9], seed=4)
    layout = train_layout(windows, offsets, model.num_levels - 1, 3, g)
    exact = model.forward_train(layout)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = model.forward_train(layout)
    assert set(low) == set(exact) and {"parallel", "long_id", "draft"} <= set(low)
    assert not torch.equal(low["loss"], exact["loss"])  # the products did run in bf16
    for name, loss in exact.items():
        assert low[name].dtype == torch.float32
        torch.testing.assert_close(low[name], loss, rtol=0.01, atol=0.0, msg=name)
