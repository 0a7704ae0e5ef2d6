"""The ``llm`` decoder of /v1/recommend: the service's LLM names the items by title, decoded
under the catalogue of the data's titles (``llm.title_recommender``), so every item is real.

Requests of one k share one batched beam search (each row's result is the one it would get
alone, up to float rounding). Users and item ids resolve as for the other decoders
(``serve.retrieval.Retriever``); ``exclude_seen`` and decoder options are refused: the list is
the LLM's K best titles as they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from genrec_spec.llm.title_recommender import TitleRecommender
from genrec_spec.serve.errors import ServeInputError
from genrec_spec.serve.retrieval import Query, Retriever
from genrec_spec.serve.schemas import MAX_BEAMS, RecommendRequest


@dataclass(frozen=True)
class TitleKey:
    k: int


class TitleRetriever:
    """An LLM over the titles of the service's data."""

    def __init__(self, recommender: TitleRecommender, retriever: Retriever) -> None:
        self.recommender, self.retriever = recommender, retriever

    def prepare(self, request: RecommendRequest) -> tuple[TitleKey, Query]:
        self.retriever.check_k(request.k)
        if request.k > MAX_BEAMS:  # its beams are k wide: 150 ran past the timeout, and on
            # after it, holding up the LLM's later requests
            raise ServeInputError(
                f"k = {request.k} is more than the llm decoder's {MAX_BEAMS} (its beam search "
                "keeps k beams, each a tree node the LLM scores every step)",
                f"ask the llm decoder for k <= {MAX_BEAMS}, or use another decoder",
            )
        if request.options or request.exclude_seen:
            raise ServeInputError(
                "the llm decoder takes no options and no exclude_seen",
                "send user_id or history and k only",
            )
        history = self.retriever.history_of(request)
        if not history:
            raise ServeInputError(
                "the llm decoder needs at least one item in the history",
                "send a non-empty history or a known user_id",
            )
        return TitleKey(request.k), Query(request.user_id, history, [])

    def run(self, key: TitleKey, queries: Sequence[Query]) -> tuple[list[dict], dict]:
        out = self.recommender.recommend([q.history for q in queries], k=key.k)
        stats = {n: v for n, v in out.stats.as_dict().items() if isinstance(v, int | float)}
        item_ids = self.retriever.data.item_ids
        used = self.recommender.config.history
        answers = [
            {
                "user_id": query.user_id,
                "decoder": "llm",
                "k": key.k,
                "items": [item_ids[i] for i in out.items[row].tolist()],
                "scores": out.scores[row].tolist(),
                "history_length": len(query.history),
                "history_used": min(len(query.history), used),
                "truncated": len(query.history) > used,
                "cold_start": False,
                "excluded": 0,
                "batch_size": len(queries),
                "stats": stats,
            }
            for row, query in enumerate(queries)
        ]
        return answers, stats
