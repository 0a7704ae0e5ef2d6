import pytest
import torch

from genrec_spec.kernels import (
    TreeAttentionError,
    ancestor_bitmask,
    ancestor_mask,
    tree_depths,
)


def walk_up(parents: list[int], i: int) -> list[int]:
    """Node i and its ancestors, found by following parent links one at a time."""
    path = [i]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path


@pytest.mark.parametrize("n", [1, 2, 7, 33, 100])
def test_ancestor_mask_and_depths_match_walking_up(n, tree_kinds, random_parents):
    g = torch.Generator().manual_seed(n)
    parents = torch.stack([random_parents(kind, n, g) for kind in tree_kinds])  # one row per kind
    mask, depths = ancestor_mask(parents), tree_depths(parents)
    assert mask.shape == (len(tree_kinds), n, n) and mask.dtype == torch.bool
    for b, row in enumerate(parents.tolist()):
        for i in range(n):
            path = walk_up(row, i)
            expected = torch.zeros(n, dtype=torch.bool)
            expected[path] = True
            assert torch.equal(mask[b, i], expected), (tree_kinds[b], i)
            assert depths[b, i] == len(path) - 1


def test_chain_and_star():
    parents = torch.tensor([[-1, 0, 1, 2, 3], [-1, -1, -1, -1, -1]])
    assert tree_depths(parents).tolist() == [[0, 1, 2, 3, 4], [0, 0, 0, 0, 0]]
    assert torch.equal(ancestor_mask(parents)[0], torch.ones(5, 5, dtype=torch.bool).tril())
    assert torch.equal(ancestor_mask(parents)[1], torch.eye(5, dtype=torch.bool))


@pytest.mark.parametrize("n", [1, 31, 32, 33, 64, 512])
def test_bitmask_unpacks_to_the_mask(n, random_parents):
    g = torch.Generator().manual_seed(n)
    parents = torch.stack([random_parents("chain", n, g), random_parents("random", n, g)])
    words = ancestor_bitmask(parents)
    assert words.dtype == torch.int32 and words.shape == (2, n, -(-n // 32))
    bits = (words.long()[..., None] >> torch.arange(32)) & 1  # arithmetic shift: bit 31 too
    assert torch.equal(bits.flatten(2)[..., :n].bool(), ancestor_mask(parents))
    assert not bits.flatten(2)[..., n:].any()


@pytest.mark.parametrize(
    "parents, message",
    [
        (torch.tensor([[-1, 1], [-1, 0]]), r"parents\[0, 1\] = 1"),  # its own parent
        (torch.tensor([[-1, 0], [-1, 2]]), r"parents\[1, 1\] = 2"),  # a later node
        (torch.tensor([[-1, -2], [-1, 0]]), r"parents\[0, 1\] = -2"),
        (torch.tensor([[-1.0, 0.0], [-1.0, 0.0]]), "integer"),
        (torch.tensor([-1, 0]), r"\[B, N\]"),
    ],
)
def test_bad_parents_raise(parents, message):
    with pytest.raises(TreeAttentionError, match=message):
        ancestor_mask(parents)
