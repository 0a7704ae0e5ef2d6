"""The LLM behind /v1/generate: SmolLM2 text with the decoding core's methods.

Methods are those of the LLM method registry (`genrec_spec.llm.methods`) that need no trained
drafter (`UNTRAINED`; "plain" is accepted as the name of none, plain decoding). With
``num_beams`` > 1 a request is beam search (`core.beam`): plain, or with prompt lookup drafting
below the beams (method ngram) where the draft record shared by requests says it paid; the
record changes only the cost of an answer, never the answer. The quant draft
(the target's own 4-bit weights) is built once per loaded model and shared by requests: it holds
no per-request state. Every request gets a fresh
proposer and its own seeded `torch.Generator`, so an answer depends only on its request (n-gram
pools do not carry over between users, and a seeded sampled answer is reproducible).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from genrec_spec.core.beam import BeamConfig
from genrec_spec.core.decode import generate
from genrec_spec.core.draft_record import DraftRecord
from genrec_spec.core.prompt_lookup import PromptLookupDrafter
from genrec_spec.core.types import SamplingParams
from genrec_spec.llm.generation import beam_texts
from genrec_spec.llm.methods import draft_record, make_proposer
from genrec_spec.serve.errors import ServeInputError

LLMS = ("smollm2",)


@dataclass(frozen=True)
class GenerateQuery:
    prompt: str
    max_new_tokens: int
    method: str  # a registry method name ("plain" already mapped to "none")
    temperature: float
    seed: int
    chat: bool
    num_beams: int = 1  # W > 1: beam search
    num_return_sequences: int = 1  # K <= W


class TextGenerator:
    """A loaded LLM and its tokenizer."""

    def __init__(self, model, tokenizer) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.record: DraftRecord | None = None  # beam search's, made on the first ngram search

    @classmethod
    def load(cls, name: str) -> TextGenerator:
        if name not in LLMS:
            raise ServeInputError(
                f"unknown LLM {name!r}", f"name one this service can load: {', '.join(LLMS)}"
            )
        from genrec_spec.models.llm.smollm2 import load_smollm2

        return cls(*load_smollm2())

    @torch.inference_mode()
    def run(self, query: GenerateQuery) -> dict:
        """Generated text, token count and the core's decoding stats (DecodeInputError, a
        ValueError, for a prompt that does not fit the model's context)."""
        prompt = query.prompt
        if query.chat:
            prompt = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
            )
        ids = self.tokenizer(prompt)["input_ids"]
        if query.num_beams > 1:
            return self._beams(query, ids)
        out = generate(
            self.model,
            [ids],
            proposer=make_proposer(query.method, self.model),
            sampling=SamplingParams(temperature=query.temperature),
            max_new_tokens=query.max_new_tokens,
            generator=torch.Generator().manual_seed(query.seed),
            eos_token_id=self.tokenizer.eos_token_id,
        )
        tokens = out.tolist()[0]
        return {
            "method": query.method,
            "text": self.tokenizer.decode(tokens),
            "tokens": len(tokens),
            "stats": out.stats.as_dict(),
        }

    def _beams(self, query: GenerateQuery, ids: list[int]) -> dict:
        """The K best sequences by beam search, the best first as the answer's text."""
        drafter = None
        if query.method == "ngram":
            drafter = PromptLookupDrafter()
            if self.record is None:
                self.record = draft_record(self.model, "measured")
        settings = BeamConfig(
            num_beams=query.num_beams, num_return_sequences=query.num_return_sequences
        )
        record = self.record if drafter is not None else None
        stats, rows = beam_texts(
            self.model, self.tokenizer, [ids], settings, query.max_new_tokens, drafter, record
        )
        return {"method": query.method, **rows[0], "stats": stats.as_dict()}
