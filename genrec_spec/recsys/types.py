"""What every recommendation decoder returns, and the signature they share.

A decoder is a function

    decode(model, values, offsets, *, k, trie, times=None, **options) -> Recommendations

with `model` a `genrec_spec.models.recsys.recommender.SemanticIdRecommender`, the B users'
histories as item indices `values [M]` + `offsets [B+1]` (oldest first), `trie` the valid-ID
`genrec_spec.data_pipelines.trie.PrefixTrie` of the catalogue, `times` the histories'
timestamps (`models.recsys.times.HistoryTimes`, which a model with a time bias needs), and
decoder-specific options (beam width, draft source, ...). Decoders never return an item
outside the catalogue or the same item twice in a row; a row with fewer than K reachable items
is padded with item -1 and score -inf.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from torch import Tensor


@dataclass(frozen=True)
class RecommendStats:
    """What one decoder call did, summed over its batch. The first four every decoder fills; the
    rest only the decoders that have the thing counted (None elsewhere)."""

    target_passes: int  # sequential backbone passes (one-pass decoders: 1)
    nodes_scored: int  # code-tree nodes scored over all passes (one-pass decoders: 0)
    wall_time_s: float
    truncated_histories: int  # rows whose history was cut to the model's max_len
    draft_nodes: int | None = None  # prefixes a draft proposed (spec_beam, nezha)
    draft_hit_rate: float | None = None  # spec_beam: share of the needed prefixes drafted
    draft_steps: int | None = None  # nezha: levels its head expanded
    items_scored_per_user: int | None = None  # heads, rpg: catalogue items scored a user
    graph_steps: int | None = None  # rpg's graph walk: steps taken
    graph_build_s: float | None = None  # rpg's graph walk: the item graph's one-off build
    item_index: bool | None = None  # dense: True where it ranked through the item index
    fetched: int | None = None  # recommend(): items asked of the decoder (K + excluded)

    def as_dict(self) -> dict[str, int | float | bool]:
        """The counted fields (None left out), for JSON and metrics."""
        return {name: value for name, value in asdict(self).items() if value is not None}


@dataclass(frozen=True)
class Recommendations:
    items: Tensor  # [B, K] int64 item indices, best first; -1 pads
    scores: Tensor  # [B, K] float32 log-likelihood under the decoder's model; -inf pads
    stats: RecommendStats
