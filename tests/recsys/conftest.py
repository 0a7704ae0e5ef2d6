"""Helpers the recommender tests share, as fixtures (the suite runs in importlib mode, where test
modules cannot import each other)."""

from dataclasses import replace

import pytest
import torch


def _random_histories(model, lengths: list[int], seed: int = 0):
    """(values [M], offsets [B+1]) of random histories of the given lengths."""
    g = torch.Generator().manual_seed(seed)
    values = torch.randint(0, model.num_items, (sum(lengths),), generator=g)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return values, offsets


def _with_objective(config, **changes):
    """`config` with its item objective's fields changed."""
    return replace(config, item_objective=replace(config.item_objective, **changes))


@pytest.fixture(scope="session")
def random_histories():
    return _random_histories


@pytest.fixture(scope="session")
def with_objective():
    return _with_objective
