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

import functools
import importlib
import inspect
import typing
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


# The values a request body or a NAME=VALUE argument carries
PLAIN_TYPES = (bool, int, float, str, type(None))


def plain_options(decode) -> dict[str, tuple[type, ...]]:
    """A decoder's options whose values are plain (bool, int, float, str, None: what JSON and the
    command line carry), with the types each accepts; tensor-valued options are left out."""
    return dict(_plain_option_types(decode))


@functools.cache  # (reading the type hints costs ~0.1 ms, and recommend() asks on every call)
def _plain_option_types(decode) -> tuple[tuple[str, tuple[type, ...]], ...]:
    hints = typing.get_type_hints(decode)
    plain = []
    for name in decoder_options(decode):
        allowed = typing.get_args(hints[name]) or (hints[name],)
        if all(t in PLAIN_TYPES for t in allowed):
            plain.append((name, allowed))
    return tuple(plain)


def check_option(
    decoder: str, name: str, value: object, allowed: tuple[type, ...], limit: int | None = None
) -> None:
    """A plain option value must have a type the decoder takes (an int may stand for a float,
    never a float for an int: 2.5 beams is no width); given a limit, integers must lie in
    0..limit (a service's guard: a huge width would only tie up its model worker)."""
    if (
        limit is not None
        and isinstance(value, int)
        and not isinstance(value, bool)
        and not (0 <= value <= limit)
    ):
        raise DecodeOptionError(
            f"option {name!r} of decoder {decoder!r} must lie in 0..{limit}, got {value}",
            f"give a value from 0 to {limit}",
        )
    # bool is an int to Python; an int may stand for a float.
    if isinstance(value, bool):
        ok = bool in allowed
    else:
        ok = isinstance(value, allowed) or (isinstance(value, int) and float in allowed)
    if not ok:
        names = " or ".join("null" if t is type(None) else t.__name__ for t in allowed)
        raise DecodeOptionError(
            f"option {name!r} of decoder {decoder!r} takes {names}, got {value!r}",
            f"give a value of type {names}",
        )


def check_option_values(name: str, decode, options: dict) -> None:
    """The values of the `options` that decoder `name` (`decode`) takes, before it runs: each
    plain one of a type it takes (`check_option`), and none plain where it takes a tensor (a
    command line's NAME=VALUE cannot carry one)."""
    plain = plain_options(decode)
    for option, value in options_for(decode, options).items():
        if option in plain:
            check_option(name, option, value, plain[option])
        elif isinstance(value, PLAIN_TYPES):
            raise DecodeOptionError(
                f"option {option!r} of decoder {name!r} takes a tensor, got {value!r}",
                f"pass it from Python: recommend(..., {option}=...)",
            )


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
