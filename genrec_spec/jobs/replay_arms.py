"""The two arms of an A/B replay and how they are run.

An arm is a decoder with its options on a checkpoint (`Arm`, parsed from
``"decoder=beam,beam_width=20"``). `replay` decodes the same events with both arms, in time
order, in the same batches, and records each arm's lists, scores, wall time and sequential
target passes per batch. Timing is fair to both arms: the first batch is decoded once per arm
untimed (warm-up), and the arm that goes first alternates from batch to batch.

Shape letters: E events, K list length, NB batches.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from genrec_spec.jobs.errors import ReplayInputError
from genrec_spec.jobs.replay_events import Events
from genrec_spec.recsys.data import Histories
from genrec_spec.recsys.decoders.registry import (
    check_option_values,
    get_decoder,
    parse_option,
    plain_options,
)
from genrec_spec.recsys.evaluate import count_invalid
from genrec_spec.recsys.item_trie import item_trie

ARM_SYNTAX = 'decoder=NAME[,OPTION=VALUE...], e.g. "decoder=beam,beam_width=20"'


@dataclass(frozen=True)
class ReplayConfig:
    """Defaults of ``genrec-spec replay``."""

    k: int = 10  # list length and metric cut-off
    users: int = 0  # a fixed random subset of this many users (all their events); 0 = all
    seed: int = 0  # draws the user subset and the bootstrap resamples
    bootstrap: int = 1000  # bootstrap resamples per interval
    confidence: float = 0.95  # interval coverage
    batch_size: int = 64  # events per decoder call

    def __post_init__(self) -> None:
        for name, low in (("k", 1), ("users", 0), ("bootstrap", 1), ("batch_size", 1)):
            if getattr(self, name) < low:
                flag = "--" + name.replace("_", "-")
                raise ReplayInputError(
                    f"{flag} must be >= {low}, got {getattr(self, name)}",
                    f"pass {flag} {low} or more",
                )
        if not 0 < self.confidence < 1:
            raise ReplayInputError(
                f"confidence must lie in (0, 1), got {self.confidence}",
                "give a coverage such as 0.95",
            )


@dataclass(frozen=True)
class Arm:
    """One side of the comparison: a decoder, its options and the checkpoint it decodes."""

    decoder: str
    options: dict
    ckpt: Path


def parse_arm(text: str, ckpt: Path, flag: str = "--a") -> Arm:
    """``decoder=NAME[,OPTION=VALUE...]`` -> Arm; every bad part is named with the syntax."""
    fields: dict[str, str] = {}
    for part in (p.strip() for p in text.split(",")):
        name, sep, value = part.partition("=")
        if not sep or not name.strip() or not value.strip():
            raise ReplayInputError(f"{flag} {text!r}: cannot parse {part!r}", f"write {ARM_SYNTAX}")
        if name.strip() in fields:
            raise ReplayInputError(
                f"{flag} {text!r}: {name.strip()!r} is given twice", "give each name once"
            )
        fields[name.strip()] = value.strip()
    if "decoder" not in fields:
        raise ReplayInputError(f"{flag} {text!r} names no decoder", f"write {ARM_SYNTAX}")
    decoder = fields.pop("decoder")
    decode = get_decoder(decoder)  # an unknown name raises, listing the valid ones
    # Tensor-valued options (spec_beam's draft_items) cannot be written on a command line.
    settable = list(plain_options(decode))
    unknown = [name for name in fields if name not in settable]
    if unknown:
        raise ReplayInputError(
            f"{flag} {text!r}: decoder {decoder!r} takes no option {unknown[0]!r}",
            f"use one of its options: {', '.join(settable) or 'none'}",
        )
    options = dict(parse_option(f"{name}={value}") for name, value in fields.items())
    check_option_values(decoder, decode, options)  # (beam_width=2.5 is no width)
    return Arm(decoder, options, Path(ckpt))


@dataclass(frozen=True)
class ArmRun:
    """What one arm did on every event."""

    items: Tensor  # [E, K] int64 item indices, best first; -1 pads
    scores: Tensor  # [E, K] float the decoder's scores of those items; -inf pads
    batch_seconds: Tensor  # [NB] float64 wall time of each batch
    batch_passes: Tensor  # [NB] float64 sequential target passes of each batch
    invalid_items: int  # list entries outside the catalogue or repeated (0 for a correct decoder)


@torch.inference_mode()
def replay(
    models: tuple, arms: tuple[Arm, Arm], events: Events, k: int, batch_size: int
) -> tuple[ArmRun, ArmRun, Tensor]:  # A, B, batch_offsets [NB+1] int64
    """Both arms over the same batches of consecutive events (module docstring: timing)."""
    decoders = [get_decoder(arm.decoder) for arm in arms]

    def decode(side: int, part: Histories):
        model = models[side]
        return decoders[side](
            model, part.values, part.offsets, k=k, trie=item_trie(model),
            times=part.history_times(), **arms[side].options,
        )  # fmt: skip

    batches = torch.arange(len(events.histories)).split(batch_size)
    for side in (0, 1):  # warm-up: lazy caches and allocations stay out of the timings
        decode(side, events.histories.select(batches[0]))
    items, scores, seconds, passes = ([[], []] for _ in range(4))
    for number, rows in enumerate(batches):
        part = events.histories.select(rows)
        for side in (0, 1) if number % 2 == 0 else (1, 0):
            start = time.perf_counter()
            out = decode(side, part)
            seconds[side].append(time.perf_counter() - start)
            items[side].append(out.items)
            scores[side].append(out.scores)
            passes[side].append(out.stats.target_passes)
    runs = []
    for side in (0, 1):
        lists = torch.cat(items[side])
        runs.append(
            ArmRun(
                lists,
                torch.cat(scores[side]),
                torch.tensor(seconds[side], dtype=torch.float64),
                torch.tensor(passes[side], dtype=torch.float64),
                count_invalid(lists, models[side].num_items),
            )
        )
    sizes = torch.tensor([len(rows) for rows in batches])
    return runs[0], runs[1], torch.cat([sizes.new_zeros(1), sizes.cumsum(0)])
