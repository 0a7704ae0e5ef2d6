"""Catalogue-grounded LLM recommendation: an instruct LLM names the next item by its title,
constrained to the catalogue's titles, by beam search.

The prompt (the tokenizer's chat template) lists a user's most recent titles and asks for one
more; the reply is decoded under a ``Catalogue`` of every title's tokens followed by the turn
end (the tokenizer's eos token), so every one of the K results is an item, never an invented
title. Speculative beam search drafts each title's forced continuation (``CatalogueDrafter``):
once a beam's prefix names one title, the rest of it costs no extra pass.

    recommender = TitleRecommender(model, tokenizer, titles)
    out = recommender.recommend(histories, k=10)  # histories: item indices per user

Titles are "Title (Year)" where the dataset has a year (MovieLens), else the title.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from torch import Tensor

from genrec_spec.core.beam import BeamConfig, beam_search
from genrec_spec.core.catalogue_drafter import CatalogueDrafter
from genrec_spec.core.constraints import Catalogue
from genrec_spec.core.draft_record import DraftRecord
from genrec_spec.core.types import DecodeInputError, DecodeStats
from genrec_spec.llm.methods import PASS_COSTS, draft_record

ASK = (
    "Here are the movies I watched most recently, oldest first:\n{history}\n"
    "Recommend one more movie I would like. Reply with its title and year only."
)


@dataclass(frozen=True)
class TitleRecommenderConfig:
    """Defaults of catalogue-grounded LLM recommendation."""

    history: int = 10  # most recent titles listed in the prompt
    beam_width: int | None = None  # W; None: the number of results asked for
    speculative: bool = True  # draft forced title continuations (same results, fewer passes)
    draft_depth: int = CatalogueDrafter.depth  # levels drafted below each beam per pass
    draft_fanout: int = CatalogueDrafter.fanout  # draft children of nodes with at most this many
    # How a search weighs drafted nodes against the steps they save, deciding from earlier
    # searches whether it drafts (``core.draft_record``): measured (the model's pass cost,
    # timed once per machine), linear, or none (every search drafts).
    pass_cost: str = "measured"

    def __post_init__(self) -> None:
        if self.pass_cost not in PASS_COSTS:
            raise DecodeInputError(
                f"unknown pass_cost {self.pass_cost!r}", f"use one of {', '.join(PASS_COSTS)}"
            )


@dataclass(frozen=True)
class TitleRecommendations:
    items: Tensor  # [B, K] int64 item indices, best first
    scores: Tensor  # [B, K] float32 beam scores
    stats: DecodeStats


# Instruct LLMs (a chat template) that can name items: ``llm.methods.load_target`` names.
TITLE_LLMS = ("smollm2",)


def load_title_llm(name: str) -> tuple[object, object]:
    """(model, tokenizer) of an LLM of ``TITLE_LLMS``."""
    if name not in TITLE_LLMS:
        raise DecodeInputError(
            f"unknown LLM {name!r} for recommending by title",
            f"use one of {', '.join(TITLE_LLMS)} (an instruct model with a chat template)",
        )
    from genrec_spec.llm.methods import load_target

    return load_target(name)


def folder_titles(folder: Path) -> list[str] | None:
    """One title per item index of a prepared folder (its items.parquet); None without titles."""
    import pandas as pd

    items = pd.read_parquet(Path(folder) / "items.parquet").sort_values("item_index")
    return item_titles(items) if "title" in items else None


def item_titles(items) -> list[str]:
    """One title per item of a ``RawDataset.items`` table: "Title (Year)" where there is a year."""
    titles = items["title"].astype(str)
    if "year" in items:
        years = items["year"].astype(str)
        titles = titles.where(years == "", titles + " (" + years + ")")
    return titles.tolist()


class TitleRecommender:
    """An instruct LLM (any ``generate`` target) recommending catalogue items by title."""

    def __init__(
        self,
        model: object,
        tokenizer,
        titles: Sequence[str],
        config: TitleRecommenderConfig | None = None,
    ) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.titles = list(titles)
        self.config = config or TitleRecommenderConfig()
        self.eos = int(tokenizer.eos_token_id)
        sequences = [tokenizer(t, add_special_tokens=False).input_ids for t in self.titles]
        self.catalogue = Catalogue.of(sequences, len(tokenizer), eos_token_id=self.eos)
        self.record: DraftRecord | None = None  # made on the first speculative search

    def prompt(self, history: Sequence[int]) -> list[int]:
        """The chat prompt of one user (item indices, oldest first), ready for the reply."""
        recent = list(history)[-self.config.history :]
        lines = "\n".join(f"{i + 1}. {self.titles[item]}" for i, item in enumerate(recent))
        messages = [{"role": "user", "content": ASK.format(history=lines)}]
        return self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )

    def recommend(
        self, histories: Sequence[Sequence[int]], k: int = 10, speculative: bool | None = None
    ) -> TitleRecommendations:
        """The K best catalogue items for each user by constrained beam search."""
        if not histories or any(len(h) == 0 for h in histories):
            raise DecodeInputError(
                "a user has an empty history", "give every user at least one item"
            )
        bad = [i for h in histories for i in h if not 0 <= i < len(self.titles)]
        if bad:
            raise DecodeInputError(
                f"item {bad[0]} is not in the catalogue of {len(self.titles)} titles",
                "pass item indices of the dataset the recommender was built from",
            )
        config = self.config
        speculative = config.speculative if speculative is None else speculative
        drafter = None
        if speculative:
            drafter = CatalogueDrafter(self.catalogue, config.draft_depth, config.draft_fanout)
            if self.record is None:
                self.record = draft_record(self.model, config.pass_cost)
        out = beam_search(
            self.model,
            [self.prompt(h) for h in histories],
            config=BeamConfig(num_beams=config.beam_width or k, num_return_sequences=k),
            max_new_tokens=self.catalogue.trie.longest,
            eos_token_id=self.eos,
            constraint=self.catalogue,
            drafter=drafter,
            record=self.record,
        )
        # A finished beam (title tokens + eos) ends at its item's trie leaf: the first of items
        # sharing a title.
        items = self.catalogue.trie.items(out.states)
        return TitleRecommendations(items=items, scores=out.scores, stats=out.stats)
