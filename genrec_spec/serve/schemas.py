"""The service's request and response bodies (pydantic): the OpenAPI schema is built from them.

Unknown fields are refused (a typo such as ``"decoders"`` must not pass silently), and numbers
that must be integers are strict (``"k": true`` or ``"k": 2.5`` is an error, not a coercion).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, model_validator

from genrec_spec.llm.generation import check_beam_settings
from genrec_spec.llm.methods import UNTRAINED as METHODS
from genrec_spec.recsys.decoders.registry import DECODERS
from genrec_spec.serve.errors import ServeInputError

# "llm": the service's LLM names the items by title (`serve.titles`; needs `serve --llm`).
DecoderName = Literal[(*DECODERS, "llm")]
# "plain" is a readable alias of the CLI's "none" (plain autoregressive decoding).
MethodName = Literal[("plain", *METHODS)]
OptionValue = StrictBool | StrictInt | float | str | None
MAX_BEAMS = 32  # beams a request may ask for (each costs the LLM a tree node a step)


class RecommendRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    user_id: str | None = Field(
        None,
        min_length=1,
        max_length=256,
        description="a user id of the data: recommend from everything the data holds of them",
    )
    history: list[str | StrictInt] | None = Field(
        None,
        max_length=10_000,
        description="raw item ids (items.parquet item_id), oldest first; [] = a new user",
    )
    history_times: list[StrictInt] | None = Field(
        None,
        max_length=10_000,
        description="timestamps (seconds) of the history items, one each: what a time-aware "
        "model reads (others ignore them); a user_id's come from the data",
    )
    time: StrictInt | None = Field(
        None, description="the time (seconds) the list is for; default: when the request arrives"
    )
    k: StrictInt = Field(10, ge=1, description="list length (at most the service's max_k)")
    decoder: DecoderName = "beam"
    exclude_seen: StrictBool = Field(
        False, description="leave the items of the history out of the list"
    )
    options: dict[str, OptionValue] = Field(
        default_factory=dict, description='decoder options, e.g. {"beam_width": 50}'
    )

    @model_validator(mode="after")
    def one_source(self) -> RecommendRequest:
        if (self.user_id is None) == (self.history is None):
            raise ServeInputError(
                "the request names both or neither of user_id and history",
                "give exactly one of user_id (a known user) or history (item ids)",
            )
        if self.history_times is not None and len(self.history_times) != len(self.history or ()):
            raise ServeInputError(
                f"history_times holds {len(self.history_times)} timestamps for "
                f"{len(self.history or ())} history items",
                "send one timestamp per history item (a user_id's times come from the data)",
            )
        return self


class RecommendResponse(BaseModel):
    user_id: str | None
    decoder: str
    k: int
    items: list[str] = Field(description="raw item ids, best first (fewer than k if fewer exist)")
    scores: list[float] = Field(description="the decoder's log-likelihood of each item")
    history_length: int
    history_used: int = Field(description="history items the model read (its context)")
    truncated: bool
    cold_start: bool
    excluded: int = Field(description="distinct items left out (exclude_seen)")
    batch_size: int = Field(description="requests that shared this decoder call")
    stats: dict[str, float | int] = Field(description="the shared decoder call's statistics")
    latency_ms: float = Field(description="time in the service: queue wait and decoding")


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt: str = Field(min_length=1, max_length=32_000)
    max_new_tokens: StrictInt = Field(32, ge=1, description="at most the service's limit")
    method: MethodName = Field(
        "plain",
        description="plain (= none) or a method that needs no trained drafter: "
        + ", ".join(METHODS),
    )
    temperature: float = Field(0.0, ge=0.0, le=10.0, description="0 = greedy")
    seed: StrictInt = Field(
        0, ge=0, le=2**63 - 1, description="seeds the sampling (temperature > 0)"
    )
    chat: StrictBool = Field(False, description="wrap the prompt in the chat template")
    num_beams: StrictInt = Field(
        1,
        ge=1,
        le=MAX_BEAMS,
        description="W > 1: beam search (temperature 0, method plain or ngram: prompt lookup "
        "drafts where they paid in earlier requests)",
    )
    num_return_sequences: StrictInt = Field(
        1, ge=1, le=MAX_BEAMS, description="beam search: the K <= W best sequences"
    )

    @model_validator(mode="after")
    def beams_possible(self) -> GenerateRequest:
        """The generate command's rule (``llm.generation.check_beam_settings``)."""
        method = "none" if self.method == "plain" else self.method
        check_beam_settings(self.num_beams, self.num_return_sequences, self.temperature, method)
        return self


class GeneratedSequence(BaseModel):
    text: str
    tokens: int
    score: float = Field(description="beam search's score: summed log-probs / length")


class GenerateResponse(BaseModel):
    method: str
    text: str = Field(description="the generated text (beam search: the best sequence)")
    tokens: int
    score: float | None = Field(None, description="beam search: the best sequence's score")
    beams: list[GeneratedSequence] | None = Field(
        None, description="beam search: the K best sequences, best first"
    )
    stats: dict[str, float | int | list[int]]
    latency_ms: float


class UsersResponse(BaseModel):
    users: list[str]
    total: int = Field(description="users the data holds")


class ReadyResponse(BaseModel):
    ready: bool
    components: dict[str, str] = Field(description="ready, loading, off or failed: why")


class ErrorResponse(BaseModel):
    kind: str = Field(description="bad_request, invalid_request, unauthorized, too_large, ...")
    detail: str
