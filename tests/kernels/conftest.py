"""Shared helpers of the kernel tests: random trees and ragged roots (as session fixtures,
since the suite imports test files in importlib mode, where sibling modules are not importable).

The Triton interpreter switch is set in the top-level ``tests/conftest.py``.
"""

import pytest
import torch

TREE_KINDS = ("chain", "star", "branches", "random")


def make_parents(kind: str, n: int, generator: torch.Generator) -> torch.Tensor:  # -> [N] int64
    """One tree of n nodes: a chain, a star (every node a child of the root context), branches
    (several chains hanging off the root, like candidate items' code sequences) or random."""
    node = torch.arange(n)
    if kind == "chain":
        return node - 1
    if kind == "star":
        return torch.full((n,), -1)
    if kind == "branches":
        length = int(torch.randint(1, 5, (1,), generator=generator))
        return torch.where(node % length == 0, -1, node - 1)
    if kind == "random":  # each node picks any earlier node or the root context
        return (torch.rand(n, generator=generator) * (node + 1)).long() - 1
    raise ValueError(f"unknown tree kind {kind!r}; use one of {TREE_KINDS}")


def make_inputs(
    batch: int,
    hq: int,
    hkv: int,
    n: int,
    s: int,
    d: int,
    kinds: list[str],  # one tree kind per row
    root_lens: list[int],  # one length per row, each <= s
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> list[torch.Tensor]:  # q, k_root, v_root, root_lens, k_tree, v_tree, parents
    """Inputs of ``tree_attention``; the padded root positions hold NaN, which must never leak."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    q = randn(batch, hq, n, d)
    k_root, v_root = randn(batch, hkv, s, d), randn(batch, hkv, s, d)
    lens = torch.tensor(root_lens, dtype=torch.long)
    padding = (torch.arange(s) >= lens[:, None])[:, None, :, None]  # [B, 1, S, 1]
    k_root = k_root.masked_fill(padding, float("nan"))
    v_root = v_root.masked_fill(padding, float("nan"))
    k_tree, v_tree = randn(batch, hkv, n, d), randn(batch, hkv, n, d)
    parents = torch.stack([make_parents(kind, n, g) for kind in kinds])
    return [q, k_root, v_root, lens, k_tree, v_tree, parents]


@pytest.fixture(scope="session")
def tree_kinds() -> tuple[str, ...]:
    return TREE_KINDS


@pytest.fixture(scope="session")
def random_parents():
    return make_parents


@pytest.fixture(scope="session")
def random_inputs():
    return make_inputs
