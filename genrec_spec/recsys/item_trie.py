"""The valid-ID trie of a model's items (`data_pipelines.trie.PrefixTrie`), made once per item
table: what every trie-constrained decoder walks, and what the core's catalogue of the model is
laid out from (`recsys.target`).

    trie = item_trie(model)
"""

from __future__ import annotations

from genrec_spec.data_pipelines.trie import PrefixTrie
from genrec_spec.models.derived import DerivedCache

_TRIES = DerivedCache()  # item_codes table -> the trie of its items


def item_trie(model) -> PrefixTrie:
    """The valid-ID trie of the model's catalogue, built once per `item_codes` table and again
    when the table is rewritten in place (e.g. `load_state_dict`): building it costs about as
    much as a whole `heads` decode of one user, so per-request callers must not pay it each
    time."""
    codes = model.item_codes
    return _TRIES.get(
        codes, (codes,), lambda: PrefixTrie.from_codes(codes, tuple(model.codebook_sizes))
    )
