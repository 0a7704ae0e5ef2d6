"""Derived values: built once, again when a source changes, and ordinary tensors even when first
asked for in inference mode."""

from __future__ import annotations

import torch

from genrec_spec.models.derived import DerivedCache


def test_built_once_and_again_when_a_source_changes():
    cache, source, builds = DerivedCache(), torch.arange(3.0), []

    def build():
        builds.append(1)
        return source * 2

    first = cache.get(source, (source,), build)
    assert cache.get(source, (source,), build) is first and len(builds) == 1
    source.add_(1)  # an in-place rewrite bumps the version
    assert torch.equal(cache.get(source, (source,), build), torch.tensor([2.0, 4.0, 6.0]))
    assert len(builds) == 2


def test_a_value_built_in_inference_mode_is_an_ordinary_tensor():
    cache, weight = DerivedCache(), torch.ones(2, 2, requires_grad=True)
    with torch.inference_mode():
        value = cache.get(weight, (weight,), lambda: weight * 2)
    assert not value.is_inference() and not value.requires_grad
    value.add_(1)  # in place outside inference mode
    (weight * value).sum().backward()  # saved for backward
    assert torch.equal(weight.grad, torch.full((2, 2), 3.0))
