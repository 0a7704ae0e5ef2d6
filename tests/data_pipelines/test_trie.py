import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from genrec_spec.data_pipelines import trie as trie_module
from genrec_spec.data_pipelines.errors import DataError
from genrec_spec.data_pipelines.semantic_ids import SemanticIdConfig, build_semantic_ids
from genrec_spec.data_pipelines.trie import PrefixTrie


@st.composite
def code_tables(draw):
    """A table of unique item IDs [I, L] with its codebook sizes, small enough to enumerate."""
    sizes = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=4)))
    space = [st.integers(0, v - 1) for v in sizes]
    rows = draw(st.lists(st.tuples(*space), min_size=1, max_size=30, unique=True))
    return torch.tensor(rows, dtype=torch.long), sizes


def random_prefixes(draw, sizes, length, batch):
    # Mostly in-range codes, plus -1 and codes just past (or far past) the codebook.
    codes = st.integers(-1, max(sizes) + 2) | st.sampled_from([0, 1, 1000])
    rows = draw(st.lists(st.tuples(*[codes] * length), min_size=batch, max_size=batch))
    return torch.tensor(rows, dtype=torch.long).reshape(batch, length)


@settings(max_examples=150, deadline=None)
@given(table=code_tables(), data=st.data())
def test_matches_set_of_tuples_oracle(table, data):
    codes, sizes = table
    trie = PrefixTrie.from_codes(codes, sizes)
    ids = [tuple(r) for r in codes.tolist()]
    prefixes_of = {ids_row[:l] for ids_row in ids for l in range(len(sizes) + 1)}
    batch = data.draw(st.integers(2, 6))
    for length in range(len(sizes) + 1):
        # Half real prefixes (so valid rows are common), half random ones.
        real = codes[torch.randint(len(codes), (batch,)), :length]
        rand = random_prefixes(data.draw, sizes, length, batch)
        queries = torch.cat([real, rand])  # [2B, length]
        expect = [tuple(q) in prefixes_of for q in queries.tolist()]
        assert trie.contains(queries).tolist() == expect
        if length < len(sizes):
            node = trie.node_of(queries)
            allowed = trie.allowed_mask(node, length)  # [2B, V]
            choice = trie.has_choice(node).tolist()  # [2B]
            for q, row, more in zip(queries.tolist(), allowed.tolist(), choice, strict=True):
                valid = {r[length] for r in ids if r[:length] == tuple(q)}
                assert {c for c, ok in enumerate(row) if ok} == valid
                assert more == (len(valid) > 1)
        else:
            items = trie.item_of(queries).tolist()
            assert items == [
                ids.index(tuple(q)) if tuple(q) in ids else -1 for q in queries.tolist()
            ]


def test_small_trie_by_hand():
    codes = torch.tensor([[1, 2, 0], [1, 2, 1], [0, 3, 0], [1, 0, 0]])
    trie = PrefixTrie.from_codes(codes, (2, 4, 2))
    assert trie.level_starts == (0, 1, 3, 6, 10)
    assert trie.item_of(codes).tolist() == [0, 1, 2, 3]
    root = trie.root(3)
    assert trie.allowed_mask(root, 0).tolist() == [[True, True]] * 3
    node = trie.child(root, torch.tensor([1, 0, 2]))  # code 2 is past level 0's codebook
    assert (node[:2] > 0).all() and node[2] == -1
    assert trie.allowed_mask(node, 1).tolist() == [
        [True, False, True, False],
        [False, False, False, True],
        [False, False, False, False],
    ]
    # A node asked about at the wrong level allows nothing (no host sync to validate it).
    assert not trie.allowed_mask(node, 2).any()
    assert trie.contains(torch.zeros(4, 0, dtype=torch.long)).all()  # the empty prefix


def test_arrays_are_narrow_and_lookups_are_int64():
    codes = torch.tensor([[1, 2, 0], [1, 2, 1], [0, 3, 0], [1, 0, 0]])
    trie = PrefixTrie.from_codes(codes, (2, 4, 2)).to("cpu")
    assert trie.child_offsets.dtype == torch.int32 and trie.leaf_items.dtype == torch.int32
    assert trie.child_codes.dtype == torch.int16 and trie.edge_keys.dtype == torch.int64
    node = trie.child(trie.root(3), torch.tensor([1, 0, 1]))
    assert node.dtype == torch.int64
    assert trie.allowed_mask(node, 1).dtype == torch.bool
    assert trie.has_choice(node).dtype == torch.bool
    assert trie.item_of(codes).dtype == torch.int64
    # A codebook past int16 stores its codes as int32, and they still round-trip.
    wide_codes = torch.tensor([[0, 40_000], [1, 0], [0, 7]])
    wide = PrefixTrie.from_codes(wide_codes)
    assert wide.child_codes.dtype == torch.int32
    assert wide.item_of(wide_codes).tolist() == [0, 1, 2]
    node = wide.child(wide.root(2), torch.tensor([0, 1]))
    assert wide.allowed_mask(node, 1).nonzero().tolist() == [[0, 7], [0, 40_000], [1, 0]]


def test_refuses_more_nodes_than_int32_ids_hold(monkeypatch):
    codes = torch.tensor([[1, 2, 0], [1, 2, 1], [0, 3, 0], [1, 0, 0]])  # 10 nodes
    monkeypatch.setattr(trie_module, "INDEX_LIMIT", 9)  # stands in for int32's largest value
    with pytest.raises(DataError, match="10 nodes, more than its int32 node ids"):
        PrefixTrie.from_codes(codes, (2, 4, 2))
    monkeypatch.setattr(trie_module, "INDEX_LIMIT", 10)
    assert PrefixTrie.from_codes(codes, (2, 4, 2)).level_starts[-1] == 10


def test_real_ids_round_trip():
    gen = torch.Generator().manual_seed(0)
    emb = torch.randn(200, 16, generator=gen)
    ids = build_semantic_ids(emb, SemanticIdConfig(levels=2, codebook_size=8))
    trie = PrefixTrie.from_codes(ids.codes, ids.codebook_sizes)
    assert trie.item_of(ids.codes).tolist() == list(range(200))
    # Walking each item's ID level by level, its next code is always allowed.
    node = trie.root(200)
    for level in range(trie.levels):
        allowed = trie.allowed_mask(node, level)  # [I, V]
        assert allowed.gather(1, ids.codes[:, level : level + 1]).all()
        node = trie.child(node, ids.codes[:, level])
    assert (node >= trie.level_starts[-2]).all()
    # Changing the last (collision) code to an unused value names no item.
    wrong = ids.codes.clone()
    wrong[:, -1] = ids.codebook_sizes[-1]
    assert (trie.item_of(wrong) == -1).all()


def test_bad_tables_raise():
    with pytest.raises(DataError, match="share a Semantic ID"):
        PrefixTrie.from_codes(torch.tensor([[0, 1], [0, 1], [1, 1]]))
    with pytest.raises(DataError, match="codebook size"):
        PrefixTrie.from_codes(torch.tensor([[0, 3], [1, 1]]), (2, 2))
    with pytest.raises(DataError, match="non-empty"):
        PrefixTrie.from_codes(torch.zeros(0, 3, dtype=torch.long))
    trie = PrefixTrie.from_codes(torch.tensor([[0, 1], [1, 1]]))
    with pytest.raises(DataError, match="full IDs"):
        trie.item_of(torch.tensor([[0], [1]]))
    with pytest.raises(DataError, match="prefixes"):
        trie.contains(torch.zeros(2, 3, dtype=torch.long))
