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


def _random_recommender(config, seed: int, sizes: tuple[int, ...], items: int):
    """A model of `config` over `items` items with unique random Semantic IDs (the given level
    sizes, a collision code appended) and large random weights, so the code distributions are
    peaked like a trained model's instead of near-uniform."""
    from genrec_spec.models.recsys.recommender import SemanticIdRecommender

    g = torch.Generator().manual_seed(seed)
    codes = torch.stack([torch.randint(0, v, (items,), generator=g) for v in sizes], dim=1)
    collision = torch.zeros(items, dtype=torch.long)
    seen: dict[tuple, int] = {}
    for i, key in enumerate(map(tuple, codes.tolist())):
        collision[i] = seen.get(key, 0)
        seen[key] = int(collision[i]) + 1
    model = SemanticIdRecommender(
        config, torch.cat([codes, collision[:, None]], dim=1), [*sizes, int(collision.max()) + 1]
    )
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model.eval()


def _uneven_histories(model, users: int, seed: int):
    """(values [M], offsets [B+1]) of uneven rows: an empty one first, and ones longer than
    max_len (truncated)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, model.config.max_len + 6, (users,), generator=g)
    lengths[0] = 0
    values = torch.randint(0, model.num_items, (int(lengths.sum()),), generator=g)
    return values, torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])


def _with_objective(config, **changes):
    """`config` with its item objective's fields changed."""
    return replace(config, item_objective=replace(config.item_objective, **changes))


@pytest.fixture(scope="session")
def random_histories():
    return _random_histories


@pytest.fixture(scope="session")
def random_recommender():
    return _random_recommender


@pytest.fixture(scope="session")
def uneven_histories():
    return _uneven_histories


@pytest.fixture(scope="session")
def with_objective():
    return _with_objective
