"""Decoding in inference mode: what the recommender's public decode functions run under.

    @inference
    def decode(model, values, offsets, *, k, trie, ...) -> Recommendations: ...

Inference mode skips autograd's bookkeeping that ``no_grad`` still does (version counters,
view tracking): a decode makes far fewer aten calls and takes less CPU time
(docs/results/recsys-speed.md). Its tensors cannot be saved for backward nor changed in place
outside inference mode, so what the function returns is handed back as ordinary tensors (a
[B, K] copy), which a caller may use anywhere; caches built on the way are ordinary tensors too
(``models.derived``).
"""

from __future__ import annotations

import functools
from dataclasses import replace

import torch
from torch import Tensor

from genrec_spec.recsys.types import Recommendations


def inference(function):
    """``function`` run in inference mode, its tensors (a Tensor or Recommendations) returned
    as ordinary ones."""

    @functools.wraps(function)
    def run(*args, **kwargs):
        with torch.inference_mode():
            out = function(*args, **kwargs)
        return _ordinary(out)

    return run


def _ordinary(out: Tensor | Recommendations) -> Tensor | Recommendations:
    if isinstance(out, Recommendations):
        return replace(out, items=_ordinary(out.items), scores=_ordinary(out.scores))
    # (in a caller's own inference mode the copy is an inference tensor, as its callers expect)
    return out.clone() if out.is_inference() else out
