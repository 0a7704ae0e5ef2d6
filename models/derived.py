"""Values derived from tensors, computed once and again only when those tensors change.

A prepacked copy of a weight (`llama.linear`), the valid-ID trie of a model's item codes
(`recsys.item_trie`) and its node tables (`recsys.scoring.TrieIndex`), RPG's item table and
graph (`recsys.rpg`): each is too costly to rebuild on every decode call, depends only on a few
tensors, and must follow them when an optimiser step or `load_state_dict` rewrites them in place
(both bump the version counter) or when they are replaced (another storage).

Values are built outside inference mode (and without autograd), so a value first asked for by a
decoder (which runs in inference mode) is an ordinary tensor that training may still use.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.utils.weak
from torch import Tensor


class DerivedCache:
    """One value per owner object, weakly keyed by its identity (the value goes with the owner),
    rebuilt when a source tensor's version or storage or the caller's extra key changes."""

    def __init__(self) -> None:
        self._values = torch.utils.weak.WeakIdKeyDictionary()  # owner -> (key, value)

    def get(
        self,
        owner: Any,  # the object the value belongs to (a tensor, a module)
        sources: tuple[Tensor, ...],  # the tensors the value is computed from
        build: Callable[[], Any],
        extra: Any = None,  # anything else the value depends on (compared with ==)
    ) -> Any:
        key = ([(t._version, t.data_ptr()) for t in sources], extra)
        cached = self._values.get(owner)
        if cached is None or cached[0] != key:
            # An inference tensor could not be updated in place, nor saved for backward, later
            with torch.inference_mode(False), torch.no_grad():
                cached = (key, build())
            self._values[owner] = cached
        return cached[1]
