"""Decoding in inference mode: what the recommender's public decode functions run under.

    @inference
    def decode(model, values, offsets, *, k, trie, ...) -> Recommendations: ...

Inference mode skips autograd's bookkeeping that ``no_grad`` still does (its dispatch, version
counters, view tracking): the calls are the same, each costs less, and a batch-1 decode is
thousands of small calls (docs/results/recsys-speed.md). Its tensors cannot be saved for
backward nor changed in place outside inference mode, so what the function returns to a caller
outside inference mode is handed back as ordinary tensors (a [B, K] copy), which it may use
anywhere; a caller already in inference mode (``evaluate``, ``recommend``, one decoder calling
another) takes them as they are. Caches built on the way are ordinary tensors
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
    as ordinary ones to a caller outside it."""

    @functools.wraps(function)
    def run(*args, **kwargs):
        if torch.is_inference_mode_enabled():
            return function(*args, **kwargs)
        with torch.inference_mode():
            out = function(*args, **kwargs)
        return _ordinary(out)

    return run


def _ordinary(out: Tensor | Recommendations) -> Tensor | Recommendations:
    if isinstance(out, Recommendations):
        return replace(out, items=_ordinary(out.items), scores=_ordinary(out.scores))
    return out.clone() if out.is_inference() else out
