"""What every recommendation decoder returns, and the signature they share.

A decoder is a function

    decode(model, values, offsets, *, k, trie, **options) -> Recommendations

with `model` a `genrec_spec.models.recsys.recommender.SemanticIdRecommender`, the B users'
histories as item indices `values [M]` + `offsets [B+1]` (oldest first), `trie` the valid-ID
`genrec_spec.data_pipelines.trie.PrefixTrie` of the catalogue, and decoder-specific options
(beam width, draft source, ...). Decoders never return an item outside the catalogue or the same
item twice in a row; a row with fewer than K reachable items is padded with item -1 and score
-inf.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor


@dataclass(frozen=True)
class Recommendations:
    items: Tensor  # [B, K] int64 item indices, best first; -1 pads
    scores: Tensor  # [B, K] float32 log-likelihood under the decoder's model; -inf pads
    stats: dict = field(default_factory=dict)
    # stats keys every decoder fills: "target_passes" (sequential forward passes of the
    # backbone per batch), "nodes_scored" (tree nodes scored in total), "wall_time_s",
    # "truncated_histories" (rows whose history was cut to the model's max_len); draft-based
    # decoders add "draft_nodes" and "draft_hit_rate" (fraction of needed prefixes drafted).
