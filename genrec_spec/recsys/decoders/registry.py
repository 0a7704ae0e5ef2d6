"""The recommendation decoders by name: the one list that `recommend`, the CLI's help texts, the
service's request schema and every validation read.

    get_decoder("spec_beam")  # -> decode(model, values, offsets, *, k, trie, **options)

Each entry names its decode function (imported only when asked for, so reading the list costs
no torch import), says in one line what it does, whether it is exact (`lossless`: the same top-K
as plain trie-constrained beam search) and which part of the model it reads beyond the backbone.
Every decode function has the signature of `recsys.types`; its keyword-only parameters other than
`k`, `trie` and `times` are its options.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass

from genrec_spec.recsys.errors import DecodeOptionError, RecommendInputError


@dataclass(frozen=True)
class DecoderInfo:
    """One registered decoder."""

    function: str  # "module:function" of its decode function
    help: str  # what it does, one line
    lossless: bool  # its lists are exactly beam's (same items, same order)
    needs: str | None = None  # the model part it reads beyond the backbone (None: nothing)


DECODERS: dict[str, DecoderInfo] = {
    "beam": DecoderInfo(
        "genrec_spec.recsys.decoders.beam:decode",
        "trie-constrained beam search over the Semantic-ID codes (TIGER), the baseline",
        lossless=True,
    ),
    "spec_beam": DecoderInfo(
        "genrec_spec.recsys.decoders.spec_beam:decode",
        "lossless speculative beam search: beam's lists in fewer sequential passes",
        lossless=True,
    ),
    "heads": DecoderInfo(
        "genrec_spec.recsys.decoders.heads:decode",
        "PinRec-style parallel level heads: every level from one pass, top-K of the catalogue",
        lossless=False,
        needs="parallel_heads",
    ),
    "rpg": DecoderInfo(
        "genrec_spec.recsys.decoders.rpg:decode",
        "RPG-style long IDs predicted in one pass, scored exactly (over an item graph from "
        "10^5 items)",
        lossless=False,
        needs="long_id_heads",
    ),
    "nezha": DecoderInfo(
        "genrec_spec.recsys.decoders.nezha:decode",
        "NEZHA-style: one backbone pass, then a small recurrent draft head runs the beam",
        lossless=False,
        needs="draft_head",
    ),
    "dense": DecoderInfo(
        "genrec_spec.recsys.decoders.dense:decode",
        "top-K of the catalogue by the item objective (SASRec's scoring), one pass",
        lossless=False,
        needs="item_objective",
    ),
}


def decoder_names() -> str:
    """The registered names, comma-separated, for help texts and error messages."""
    return ", ".join(DECODERS)


def get_decoder(name: str):
    """The decode function registered under `name`."""
    if name not in DECODERS:
        raise RecommendInputError(
            f"unknown decoder {name!r}; valid decoders: {decoder_names()}",
            "pass one of the registered names (genrec_spec.recsys.decoders.DECODERS)",
        )
    module, function = DECODERS[name].function.split(":")
    return getattr(importlib.import_module(module), function)


def runs_on(model, name: str) -> bool:
    """Whether `model` has the part decoder `name` reads beyond the backbone."""
    needs = DECODERS[name].needs
    return needs is None or getattr(model, needs, None) is not None


def decoder_options(decode) -> list[str]:
    """The names of a decoder's own options (its keyword-only parameters but the ones every
    decoder takes: k, trie and times)."""
    return [
        p.name
        for p in inspect.signature(decode).parameters.values()
        if p.kind == p.KEYWORD_ONLY and p.name not in ("k", "trie", "times")
    ]


def options_for(decode, options: dict) -> dict:
    """The subset of `options` that `decode` takes."""
    accepted = decoder_options(decode)
    return {name: value for name, value in options.items() if name in accepted}


def check_options(decoders: dict, options: dict) -> None:
    """Every option must be taken by at least one of the decoders (name -> decode; a typo
    otherwise)."""
    unused = set(options) - {n for d in decoders.values() for n in options_for(d, options)}
    if unused:
        takes = "; ".join(f"{n}: {decoder_options(d)}" for n, d in decoders.items())
        raise DecodeOptionError(
            f"no listed decoder takes the option(s) {sorted(unused)}; {takes}",
            "drop the option or correct its name to one a listed decoder takes",
        )


def parse_option(text: str) -> tuple[str, object]:
    """NAME=VALUE with VALUE read as an int, a float, true/false, or else a string."""
    name, sep, raw = text.partition("=")
    if not sep or not name.strip():
        raise DecodeOptionError(
            f"decoder option {text!r} does not look like NAME=VALUE",
            "write it as NAME=VALUE, e.g. beam_width=50",
        )
    raw = raw.strip()
    if raw.lower() in ("true", "false"):
        return name.strip(), raw.lower() == "true"
    for kind in (int, float):
        try:
            return name.strip(), kind(raw)
        except ValueError:
            continue
    return name.strip(), raw
