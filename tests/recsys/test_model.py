"""The Semantic-ID recommender: shapes, tree scoring = chain scoring, the code levels tied to the
item objective, exact item scores, heads, bad input (its training losses: test_model_losses)."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from genrec_spec.kernels import ancestor_mask, prepare_tree
from genrec_spec.models.recsys import attention
from genrec_spec.models.recsys.attention import (
    pointwise_attention,
    pointwise_tree_attention,
    relative_bias,
)
from genrec_spec.models.recsys.config import (
    ConfigError,
    ItemObjectiveConfig,
    RecommenderConfig,
    TiedLevelsConfig,
)
from genrec_spec.models.recsys.errors import RecommenderInputError
from genrec_spec.models.recsys.heads import LongIdHeads, ParallelLevelHeads, _IndependentCodeHeads
from genrec_spec.models.recsys.item_scores import item_log_likelihoods
from genrec_spec.models.recsys.layout import prefix_forest, train_layout


def _objective(config, **changes):
    """`config` with its item objective's fields changed."""
    from dataclasses import replace

    return replace(config, item_objective=replace(config.item_objective, **changes))


def _histories(model, lengths: list[int], seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    values = torch.randint(0, model.num_items, (sum(lengths),), generator=g)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return values, offsets


def _random_tree(model, batch: int, nodes: int, seed: int = 0):
    """Random prefix trees: each node a child of the root or of an earlier node, with codes and
    levels consistent along every path (a node's level = its parent's + 1, at most L-2)."""
    g = torch.Generator().manual_seed(seed)
    parents = torch.full((batch, nodes), -1)
    levels = torch.zeros(batch, nodes, dtype=torch.long)
    for b in range(batch):
        for i in range(1, nodes):
            p = int(torch.randint(-1, i, (1,), generator=g))
            if p >= 0 and levels[b, p] < model.num_levels - 2:
                parents[b, i], levels[b, i] = p, levels[b, p] + 1
    sizes = torch.tensor(model.codebook_sizes)[levels]
    codes = (torch.rand(batch, nodes, generator=g) * sizes).long()
    return codes, levels, parents


def _path(parents: torch.Tensor, node: int) -> list[int]:  # root-to-node path of one row
    path = [node]
    while parents[path[0]] >= 0:
        path.insert(0, int(parents[path[0]]))
    return path


def test_shapes_and_padding(block_model):
    model, _ = block_model
    values, offsets = _histories(model, [5, 0, 20])  # an empty and a truncated history
    state = model.encode_history(values, offsets)
    layers, heads, dim = model.config.layers, model.config.heads, model.config.dim
    assert state.keys.shape == (layers, 3, heads, model.config.max_len + 1, dim // heads)
    assert state.lengths.tolist() == [6, 1, model.config.max_len + 1]
    assert state.truncated.tolist() == [False, False, True]
    assert state.hidden.shape == (3, dim)
    assert state.level0_log_probs.shape == (3, model.codebook_sizes[0])
    assert torch.allclose(state.level0_log_probs.exp().sum(1), torch.ones(3))

    codes, levels, parents = _random_tree(model, 3, 9)
    out = model.score_tree(state, codes, levels, parents)
    assert out.shape == (3, 9, max(model.codebook_sizes[1:]))
    for b in range(3):
        for i in range(9):
            width = model.codebook_sizes[int(levels[b, i]) + 1]
            assert torch.isinf(out[b, i, width:]).all()
            assert torch.allclose(out[b, i, :width].exp().sum(), torch.tensor(1.0), atol=1e-5)


def test_tree_equals_each_branch_as_a_chain(block_model):
    model, _ = block_model
    values, offsets = _histories(model, [7, 3, 11], seed=1)
    state = model.encode_history(values, offsets)
    codes, levels, parents = _random_tree(model, 3, 10, seed=2)
    tree = model.score_tree(state, codes, levels, parents)
    for b in range(3):
        one = values[offsets[b] : offsets[b + 1]]
        row = model.encode_history(one, torch.tensor([0, len(one)]))
        for i in range(10):
            path = torch.tensor(_path(parents[b], i))
            chain = model.score_tree(
                row, codes[b, path][None], levels[b, path][None], torch.arange(len(path))[None] - 1
            )
            torch.testing.assert_close(chain[0, -1], tree[b, i], atol=1e-5, rtol=1e-5)
    # last=: the last nodes' log-probs alone (the others only as context), as beam asks.
    last = model.score_tree(state, codes, levels, parents, last=4)
    torch.testing.assert_close(last, tree[:, -4:])


@pytest.mark.parametrize(("temperature", "residual"), [(0.0, False), (0.05, False), (0.05, True)])
def test_item_tied_levels_are_item_softmax_conditionals(tiny_model, temperature, residual):
    """Tied levels: at a prefix node, with the code heads zeroed, the log-probs of the next
    level are the item objective's (at the node's state) summed over the items under each child
    and renormalised over the prefix's items; codes that lead to no item get -inf; training
    gives finite gradients. The item logits are dot products, or with a temperature cosine
    similarities over it; with a residual the node's query is the history state's plus the
    node's (random here) correction."""

    from genrec_spec.models.recsys.recommender import SemanticIdRecommender

    def item_logits(rows, hidden, node=None):  # [I', D], [D], node state [D] -> [I']
        if temperature:
            rows, hidden = F.normalize(rows, dim=-1), F.normalize(hidden, dim=-1) / temperature
        if node is not None and residual:  # hidden is the history state
            hidden = hidden + model.node_item_query(node)
        return hidden @ rows.T

    base, data = tiny_model
    config = _objective(
        base.config,
        level0=True,
        tied_levels=TiedLevelsConfig(residual=residual),
        temperature=temperature,
    )
    torch.manual_seed(3)
    model = SemanticIdRecommender(config, data.item_codes, data.codebook_sizes).eval()
    with torch.no_grad():
        for head in model.code_heads[1:]:
            head.weight.zero_()
            head.bias.zero_()
        if residual:  # starts at 0 (the next test); a random correction checks its wiring
            model.node_item_query.weight.normal_(std=1.0)
    windows, offsets = _histories(model, [6, 13, 1], seed=4)
    state = model.encode_history(windows, offsets)
    codes, levels, parents = _random_tree(model, 3, 9, seed=5)
    states = []  # the nodes' final states [B, N, D], caught at the final norm
    hook = model.norm.register_forward_hook(lambda module, args, out: states.append(out))
    out = model.score_tree(state, codes, levels, parents)  # [B, N, Vmax]
    hook.remove()
    table = model.embeddings.embeddings["t_item"].weight
    torch.testing.assert_close(model.item_scores(state.hidden), item_logits(table, state.hidden))
    empty = 0
    for b in range(3):
        for n in range(codes.shape[1]):
            prefix = codes[b, _path(parents[b], n)]
            level = len(prefix)  # the level predicted
            under = (model.item_codes[:, :level] == prefix).all(dim=1)
            got = out[b, n, : model.codebook_sizes[level]]
            if not under.any():
                empty += 1
                assert torch.isneginf(got).all()
                continue
            node = states[0][b, n]
            query = state.hidden[b] if residual else node
            item_lp = item_logits(table[under], query, node).log_softmax(dim=0)
            child = model.item_codes[under, level]
            want = torch.full_like(got, float("-inf"))
            for c in child.unique():
                want[c] = item_lp[child == c].logsumexp(dim=0)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert 0 < empty < codes.numel()  # random trees hold prefixes with and without items
    torch.testing.assert_close(model.score_tree(state, codes, levels, parents, last=3), out[:, -3:])

    layout = train_layout(windows, offsets, model.num_levels - 1, 3, torch.Generator())
    losses = model.train().forward_train(layout)
    model.eval()
    losses["loss"].backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    with pytest.raises(ConfigError, match="temperature -1.0 >= 0"):
        ItemObjectiveConfig(temperature=-1.0)


def test_item_levels_residual_starts_as_the_item_softmax(tiny_model):
    """Tied levels with a residual: with the node correction at its initial 0 and the code
    heads at 0, every item's exact trie-constrained log-likelihood (what beam search ranks by)
    equals the item softmax at the history state (what `dense` ranks by): the levels
    telescope."""

    from genrec_spec.models.recsys.recommender import SemanticIdRecommender

    base, data = tiny_model
    config = _objective(
        base.config, level0=True, tied_levels=TiedLevelsConfig(residual=True), temperature=0.05
    )
    torch.manual_seed(7)
    model = SemanticIdRecommender(config, data.item_codes, data.codebook_sizes).eval()
    assert not model.node_item_query.weight.any()
    with torch.no_grad():
        for head in model.code_heads[1:]:
            head.weight.zero_()
            head.bias.zero_()
    state = model.encode_history(*_histories(model, [6, 0, 30], seed=8))
    everything = torch.arange(model.num_items)
    torch.testing.assert_close(
        item_log_likelihoods(model, state, everything),
        model.item_scores(state.hidden).log_softmax(dim=-1),
        atol=1e-4,
        rtol=1e-4,
    )
    with torch.no_grad():  # a correction moves them apart (the test can fail)
        model.node_item_query.weight.normal_(std=1.0)
    moved = item_log_likelihoods(model, state, everything)
    assert (moved - model.item_scores(state.hidden).log_softmax(dim=-1)).abs().max() > 0.1


def test_unit_item_keys_follow_the_weights(tiny_model):
    """With a temperature the unit-length item table is kept between no-grad calls and built
    again when the item embeddings are rewritten in place (an optimiser step, load_state_dict);
    under autograd the gradient reaches the table."""

    from genrec_spec.models.recsys.recommender import SemanticIdRecommender

    base, data = tiny_model
    config = _objective(base.config, temperature=0.05)
    model = SemanticIdRecommender(config, data.item_codes, data.codebook_sizes).eval()
    hidden = torch.randn(2, config.dim)
    table = model.embeddings.embeddings["t_item"].weight

    def fresh():  # [2, I]
        return F.normalize(hidden, dim=-1) / 0.05 @ F.normalize(table.detach(), dim=-1).T

    with torch.no_grad():
        torch.testing.assert_close(model.item_scores(hidden), fresh())
        table.add_(torch.randn_like(table))
        torch.testing.assert_close(model.item_scores(hidden), fresh())
    model.item_scores(hidden).sum().backward()
    assert table.grad is not None and table.grad.abs().sum() > 0


def _chain_log_probs(model, state, item: int) -> list[torch.Tensor]:  # L x [B, V_l]
    """Log-probs of every level along one item's code chain, the item scored alone."""
    codes, batch = model.item_codes[item], state.lengths.numel()
    levels = torch.arange(model.num_levels - 1)
    chain = model.score_tree(
        state,
        codes[None, :-1].expand(batch, -1),
        levels.expand(batch, -1),
        (levels - 1).expand(batch, -1),
    )
    return [state.level0_log_probs] + [chain[:, i] for i in range(model.num_levels - 1)]


@pytest.mark.parametrize("chunk", [1, 4, 64])  # chunks split subtrees, or hold all of them
def test_item_log_likelihoods_are_exact(tiny_model, chunk):
    model, _ = tiny_model
    state = model.encode_history(*_histories(model, [4, 9, 0], seed=5))
    items = torch.tensor([3, 0, 17, 25, 39, 8, 30, 12])
    raw = item_log_likelihoods(model, state, items, constrained=False, chunk=chunk)
    trie = item_log_likelihoods(model, state, items, constrained=True, chunk=chunk)
    assert raw.shape == trie.shape == (3, len(items))
    codes = model.item_codes[items]  # [C, L]
    for j, item in enumerate(items.tolist()):
        per_level = _chain_log_probs(model, state, item)
        expected_raw = expected_trie = 0.0
        for level in range(model.num_levels):
            code = int(codes[j, level])
            # The trie constraint: codes that extend this item's prefix to some candidate.
            same_prefix = (codes[:, :level] == codes[j, :level]).all(dim=1)
            allowed = codes[same_prefix, level].unique()
            lp = per_level[level]
            expected_raw = expected_raw + lp[:, code]
            expected_trie = expected_trie + lp[:, code] - lp[:, allowed].logsumexp(dim=1)
        torch.testing.assert_close(raw[:, j], expected_raw, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(trie[:, j], expected_trie, atol=1e-5, rtol=1e-5)
    # Over the whole catalogue: a distribution over items (constrained), a sub-one mass (raw).
    everything = torch.arange(model.num_items)
    total = item_log_likelihoods(model, state, everything).exp().sum(1)
    torch.testing.assert_close(total, torch.ones(3))
    raw_total = item_log_likelihoods(model, state, everything, constrained=False).exp().sum(1)
    assert bool((raw_total < 1).all())


def test_prefix_forest_and_train_layout_structure():
    codes = torch.tensor([[0, 1, 0], [0, 1, 1], [0, 2, 0], [3, 1, 0]])
    forest = prefix_forest(codes)
    assert len(forest.codes) == 2 + 3  # prefixes (0), (3); (0,1), (0,2), (3,1)
    assert bool((forest.parents < torch.arange(len(forest.codes))).all())
    for c in range(len(codes)):
        node = int(forest.item_nodes[c, -1])
        assert forest.codes[_path(forest.parents, node)].tolist() == codes[c, :2].tolist()

    g = torch.Generator().manual_seed(0)
    layout = train_layout(torch.arange(9), torch.tensor([0, 5, 6, 9]), 2, 2, g)
    assert layout.next_items.tolist() == [[0, 1, 2, 3, 4], [5, -1, -1, -1, -1], [6, 7, 8, -1, -1]]
    assert layout.hist_items.tolist() == [0, 1, 2, 3, 6, 7]  # windows minus their last item
    assert layout.hist_offsets.tolist() == [0, 4, 4, 6]
    assert layout.branch_anchor[1].tolist() == [0, -1]  # one position only
    n = layout.parents.shape[1]
    assert n == 5 + 2 * 2 and bool((layout.parents < torch.arange(n)).all())
    for b in range(3):
        for p, anchor in enumerate(layout.branch_anchor[b].tolist()):
            assert layout.parents[b, 5 + 2 * p].item() == anchor


@pytest.mark.parametrize("branches", [1, 3, 20])
def test_layout_visibility_is_the_ancestor_mask(branches):
    g = torch.Generator().manual_seed(branches)
    lengths = torch.tensor([7, 1, 12, 4])
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    layout = train_layout(torch.arange(int(lengths.sum())), offsets, 3, branches, g)
    assert torch.equal(layout.visibility(), ancestor_mask(layout.parents))


def test_heads_shapes_and_item_scores(tiny_model):
    model, data = tiny_model
    state = model.encode_history(*_histories(model, [3, 8, 5], seed=6))
    h = state.hidden  # [B, D]
    per_level = model.parallel_heads.log_probs(h)  # [B, L, Vmax]
    assert per_level.shape == (3, model.num_levels, max(model.codebook_sizes))
    scores = model.parallel_heads.score_items(h, model.item_codes)
    item = 11
    expected = sum(per_level[:, lv, c] for lv, c in enumerate(model.item_codes[item].tolist()))
    torch.testing.assert_close(scores[:, item], expected)

    digits = model.long_id_heads.log_probs(h)
    assert digits.shape == (3, data.long_ids.shape[1], max(data.long_id_sizes))
    long_scores = model.long_id_heads.score_items(h, model.long_ids)
    assert long_scores.shape == (3, model.num_items)

    beams = 4  # the draft head runs B users x K beams at once
    draft = model.draft_head.init(h)[:, None].expand(-1, beams, -1)
    codes0 = state.level0_log_probs.topk(beams, dim=1).indices  # [B, K]
    draft, log_probs = model.draft_head.step(draft, codes0, 0)
    assert draft.shape == (3, beams, model.config.draft_head.hidden)
    assert log_probs.shape == (3, beams, model.codebook_sizes[1])
    # The same as stepping one beam alone.
    alone, alone_lp = model.draft_head.step(model.draft_head.init(h[1:2]), codes0[1:2, 2], 0)
    torch.testing.assert_close(alone_lp[0], log_probs[1, 2])
    torch.testing.assert_close(log_probs.exp().sum(-1), torch.ones(3, beams))


def _fit_level_heads(item_loss: bool) -> float:
    """Total variation, over a sparse catalogue, between a target distribution and the item
    distribution of parallel heads fitted to 4,000 samples of it from one fixed state."""
    torch.manual_seed(0)
    # 6 of the 3 x 3 code pairs are items; the target is additive in the codes over them, so the
    # heads' summed log-probs can represent it exactly.
    codes = torch.tensor([[0, 0], [0, 1], [1, 1], [1, 2], [2, 2], [2, 0]])  # [I, L]
    a, b = torch.tensor([1.5, 0.0, -1.0]), torch.tensor([0.0, 1.0, -1.5])
    target = (a[codes[:, 0]] + b[codes[:, 1]]).softmax(0)  # [I]
    items = torch.multinomial(target, 4000, replacement=True)  # [M]
    heads = ParallelLevelHeads(8, [3, 3])
    h = torch.randn(1, 8).expand(len(items), -1)  # [M, D] one state
    opt = torch.optim.Adam(heads.parameters(), lr=0.05)
    for _ in range(200):
        opt.zero_grad()
        if item_loss:
            heads.catalogue_loss(h, codes, items).backward()
        else:
            heads.loss(h, codes[items]).backward()
        opt.step()
    fitted = heads.score_items(h[:1], codes)[0].softmax(0)
    return 0.5 * float((fitted - target).abs().sum())


def test_catalogue_loss_fits_the_item_distribution_per_code_loss_does_not():
    # Per-code cross-entropy fits each level's marginal, whose product also covers the code
    # pairs that are no item: renormalised over the items it is off. The catalogue loss fits
    # the distribution the decoder ranks by.
    assert _fit_level_heads(item_loss=True) < 0.02
    assert _fit_level_heads(item_loss=False) > 0.04


@pytest.mark.parametrize("sizes", [[5, 5, 5, 5], [5, 3, 4, 2]])
def test_long_id_catalogue_loss_equals_the_summed_digit_log_probs_loss(sizes):
    # LongIdHeads composes the items' output rows instead of softmaxing each digit: the same
    # loss and gradients as the catalogue softmax of summed digit log-probs, padded digits too.
    torch.manual_seed(0)
    heads = LongIdHeads(6, sizes)
    codes = torch.stack([torch.randint(0, s, (9,)) for s in sizes], dim=1)  # [I, Q]
    h, items = torch.randn(7, 6), torch.randint(0, 9, (7,))  # [M, D], [M]
    composed = heads.catalogue_loss(h, codes, items)
    summed = _IndependentCodeHeads.catalogue_loss(heads, h, codes, items)
    torch.testing.assert_close(composed, summed)
    params = list(heads.parameters())
    for a, b in zip(
        torch.autograd.grad(composed, params), torch.autograd.grad(summed, params), strict=True
    ):
        torch.testing.assert_close(a, b)


def test_pointwise_attention_is_hstus_masked_sum():
    """Each query's output is the sum over its visible keys of SiLU(q . k) / n times the key's
    value (the definition, one query and key at a time), for a mask and the causal rule; and
    over a tree, its history keys plus its ancestors'."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 4, generator=g) for _ in range(3))  # [B, H, M=K, Dh]
    seen = torch.rand(2, 1, 5, 5, generator=g) < 0.6

    def defined(mask, table=None, times=None):  # [B, 1, M, K] bool, bias tables [R], [G]
        out = torch.zeros_like(q)
        for b, h, i, j in itertools.product(range(2), range(3), range(5), range(5)):
            if mask[b, 0, i, j]:
                bias = 0.0 if table is None else table[min(max(i - j, 0), len(table) - 1)]
                bias = bias + (0.0 if times is None else times[gap[b, i, j]])
                out[b, h, i] += F.silu(q[b, h, i] @ k[b, h, j] + bias) / 7.0 * v[b, h, j]
        return out

    torch.testing.assert_close(pointwise_attention(q, k, v, seen, 7.0), defined(seen))
    # HSTU's relative bias: b[i - j] (distances past the table read its last entry), plus a
    # time table's entry for each pair's time bucket
    table, at = torch.randn(4, generator=g), torch.arange(5)
    times, gap = torch.randn(6, generator=g), torch.randint(0, 6, (2, 5, 5), generator=g)
    bias = relative_bias((table, None), at[:, None] - at)
    got = pointwise_attention(q, k, v, seen, 7.0, bias=bias)
    torch.testing.assert_close(got, defined(seen, table))
    bias = relative_bias((table, times), at[:, None] - at, gap)
    got = pointwise_attention(q, k, v, seen, 7.0, bias=bias)
    torch.testing.assert_close(got, defined(seen, table, times))
    causal = torch.ones(5, 5, dtype=torch.bool).tril().expand(2, 1, 5, 5)
    torch.testing.assert_close(
        pointwise_attention(q, k, v, None, 7.0, causal=True), defined(causal)
    )

    # a tree of 5 nodes (node 1 under 0, 2 and 3 under 1, 4 under 0) over 4- and 2-key histories
    parents = torch.tensor([[-1, 0, 1, 1, 0]] * 2)
    lengths = torch.tensor([4, 2])
    k_root, v_root = torch.randn(2, 3, 4, 4, generator=g), torch.randn(2, 3, 4, 4, generator=g)
    plan = prepare_tree(parents, lengths, 4)
    got = pointwise_tree_attention(q, k_root, v_root, k, v, plan, 7.0)
    keys, values = torch.cat([k_root, k], 2), torch.cat([v_root, v], 2)
    history = (torch.arange(4) < lengths[:, None])[:, None, None, :].expand(2, 1, 5, 4)
    visible = ancestor_mask(parents)  # [B, N, N] itself and its ancestors
    mask = torch.cat([history, visible[:, None]], 3)  # [B, 1, N, 4 + N]
    torch.testing.assert_close(got, pointwise_attention(q, keys, values, mask, 7.0))


def test_tree_biases_are_each_blocks_own():
    """A tree pass looks up every block's biases at once: each block's pair is what
    `relative_bias` and `own_bias` give from its own tables, with and without a time table."""
    g = torch.Generator().manual_seed(2)
    distance = torch.randint(-2, 9, (3, 1, 6), generator=g)  # past both ends of the table
    gap = torch.randint(0, 5, (3, 1, 6), generator=g)
    for timed in (False, True):
        tables = [
            (torch.randn(7, generator=g), torch.randn(5, generator=g) if timed else None)
            for _ in range(4)
        ]
        for table, (history, own) in zip(
            tables, attention.tree_biases(tables, distance, gap), strict=True
        ):
            assert torch.equal(history, relative_bias(table, distance, gap))
            assert torch.equal(own, attention.own_bias(table))
    assert attention.tree_biases([None, None], distance) == [None, None]


@pytest.mark.parametrize("queries", [None, 9])
def test_pointwise_tree_attention_gathers_what_the_mask_shows(queries, monkeypatch):
    """Over a tree of more than GATHER_MIN_NODES nodes each query's keys are gathered
    (itself and its ancestors) instead of masked out of all N: the same outputs, biases
    included, for every query or the last few (a grown tree), on rows of different shapes."""
    g = torch.Generator().manual_seed(1)
    n = 40
    parents = torch.full((3, n), -1)
    for i in range(1, n):  # row 0 a forest of roots, row 1 a chain, row 2 a random tree
        parents[1, i] = i - 1
        parents[2, i] = int(torch.randint(-1, i, (1,), generator=g))
    m = queries or n
    q = torch.randn(3, 2, m, 8, generator=g)
    k, v = (torch.randn(3, 2, n, 8, generator=g) for _ in range(2))
    k_root, v_root = (torch.randn(3, 2, 6, 8, generator=g) for _ in range(2))
    lengths, bias = torch.tensor([6, 0, 3]), torch.tensor(0.3)
    plan = prepare_tree(parents, lengths, 6, queries=queries)
    history = torch.randn(3, 1, m, 6, generator=g)
    args = (q, k_root, v_root, k, v, plan, 7.0, history, bias)
    masked = pointwise_tree_attention(*args)
    monkeypatch.setattr(attention, "GATHER_MIN_NODES", n - 1)
    torch.testing.assert_close(pointwise_tree_attention(*args), masked)


def test_unknown_block_is_refused():
    with pytest.raises(ConfigError, match="unknown block 'mamba'"):
        RecommenderConfig(block="mamba")
    with pytest.raises(ConfigError, match="relative_bias needs hstu blocks"):
        RecommenderConfig(relative_bias=True)


def test_bad_input_raises_clear_errors(tiny_model):
    model, _ = tiny_model
    with pytest.raises(RecommenderInputError, match=r"\[0, 40\)"):
        model.encode_history(torch.tensor([1, 40]), torch.tensor([0, 1, 2]))
    with pytest.raises(RecommenderInputError, match="offsets"):
        model.encode_history(torch.tensor([1, 2]), torch.tensor([0, 3]))
    state = model.encode_history(*_histories(model, [3, 2]))
    top = model.num_levels - 1
    with pytest.raises(RecommenderInputError, match="predicts nothing"):
        model.score_tree(
            state,
            torch.zeros(2, 1, dtype=torch.long),
            torch.full((2, 1), top),
            torch.full((2, 1), -1),
        )
    with pytest.raises(RecommenderInputError, match="codebook"):
        model.score_tree(
            state,
            torch.full((2, 1), 99),
            torch.zeros(2, 1, dtype=torch.long),
            torch.full((2, 1), -1),
        )
    with pytest.raises(ValueError, match="parent"):
        model.score_tree(
            state,
            torch.zeros(2, 2, dtype=torch.long),
            torch.zeros(2, 2, dtype=torch.long),
            torch.tensor([[-1, 1], [-1, 0]]),
        )


def test_extend_history_equals_encoding_the_whole_history(block_model):
    model, _ = block_model
    lengths, cuts = [7, 3, 12, 1], [4, 0, 11, 0]  # prefix lengths: one empty, one full window
    values, offsets = _histories(model, lengths, seed=3)
    rows = [values[offsets[b] : offsets[b + 1]] for b in range(len(lengths))]

    def ragged(parts):
        sizes = torch.tensor([0, *[len(p) for p in parts]])
        return torch.cat(parts), sizes.cumsum(0)

    prefix = model.encode_history(*ragged([r[:c] for r, c in zip(rows, cuts, strict=True)]))
    extended = model.extend_history(
        prefix, *ragged([r[c:] for r, c in zip(rows, cuts, strict=True)])
    )
    whole = model.encode_history(values, offsets)
    assert extended.lengths.tolist() == whole.lengths.tolist()
    for b, tokens in enumerate(whole.lengths.tolist()):
        for name in ("keys", "values"):
            got, want = (
                getattr(extended, name)[:, b, :, :tokens],
                getattr(whole, name)[:, b, :, :tokens],
            )
            assert torch.allclose(got, want, atol=1e-5), (name, b)
    assert torch.allclose(extended.hidden, whole.hidden, atol=1e-5)
    assert torch.allclose(extended.level0_log_probs, whole.level0_log_probs, atol=1e-5)
    codes, levels, parents = _random_tree(model, len(lengths), 7)
    assert torch.allclose(
        model.score_tree(extended, codes, levels, parents),
        model.score_tree(whole, codes, levels, parents),
        atol=1e-5,
    )

    with pytest.raises(RecommenderInputError, match="max_len"):  # the window would slide
        model.extend_history(whole, *ragged([r[:1] for r in rows]))
    with pytest.raises(RecommenderInputError, match="at least one item"):
        model.extend_history(prefix, *ragged([r[:0] for r in rows]))
