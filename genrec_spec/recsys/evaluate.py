"""Ranking quality of recommendation decoders on a held-out split (``genrec-spec evaluate``).

    evaluate(model, histories, decode, ks=(10, 50, 200)) -> metrics
    evaluate_checkpoint(ckpt, data_dir, EvaluateConfig(...), options) -> (header, report)

Protocol (time-ordered leave-one-out, ranked against the full catalogue): every user of the
split (or a fixed random subset, `EvaluateConfig.users`) gets a top-max(K) list from the
decoder, which chooses among all catalogue items; the user's held-out next item is looked up in
that list and HR@K, NDCG@K and MRR (over the whole list) are averaged over users
(`recsys.metrics`). All decoders of one run see the same users. The report also gives each
decoder's wall time per user, its sequential backbone passes per batch, and the count of invalid
or repeated items in its lists (always 0 for a correct decoder). A time-aware model
(`models.recsys.times`) reads each history item's timestamp and, as the time of its prediction,
the held-out item's: HSTU's protocol writes the target's timestamp after the history.

`exclude_history` leaves each user's history items out of the ranking: the items the model
reads (its most recent ``max_len``), dropped from a longer list (`recommend.decode_excluding`),
the HSTU repository's protocol (it filters the ids of the model's input sequence,
`filter_invalid_ids`, "as in SASRec"); a MovieLens user rates a movie once, so the held-out item
is never among them.

Decoder options are given to every listed decoder that takes an option of that name.

Shape letters: U users evaluated, B users of a batch, K list length.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from genrec_spec.machine import set_threads
from genrec_spec.recsys.checkpoint import load_model_and_data
from genrec_spec.recsys.data import sample_users
from genrec_spec.recsys.decoders.registry import (
    check_option_values,
    check_options,
    get_decoder,
    options_for,
)
from genrec_spec.recsys.errors import RecommendInputError
from genrec_spec.recsys.item_trie import item_trie
from genrec_spec.recsys.metrics import DEFAULT_KS, ranking_metrics, ranks_from_topk
from genrec_spec.recsys.recommend import decode_excluding


@dataclass(frozen=True)
class EvaluateConfig:
    """Defaults of ``genrec-spec evaluate``."""

    split: str = "test"  # "valid" or "test"
    decoders: tuple[str, ...] = ("beam",)
    ks: tuple[int, ...] = DEFAULT_KS  # cut-offs; lists are max(ks) long
    users: int = 0  # a fixed random subset of this many users; 0 = all
    batch_size: int = 64  # users per decoder call
    seed: int = 0  # draws the user subset
    threads: int | None = None  # torch CPU threads; None: every core (batches use them all)
    exclude_history: bool = False  # leave the history items the model reads out of the lists


@torch.inference_mode()
def evaluate(
    model,  # SemanticIdRecommender
    histories,  # recsys.data.Histories of a split with targets
    decode,  # a decoder: decode(model, values, offsets, *, k, trie, times, **options)
    *,
    ks: tuple[int, ...] = DEFAULT_KS,
    batch_size: int = EvaluateConfig.batch_size,
    trie=None,  # PrefixTrie of the model's catalogue; None = item_trie(model)
    exclude_history: bool = EvaluateConfig.exclude_history,
    **options,
) -> dict:
    """Metrics of `decode` over every user of `histories` (one held-out target each):
    hr@K / ndcg@K for every K, mrr, plus users, wall_s_per_user, target_passes_per_batch and
    invalid_items (items outside the catalogue or repeated within a list)."""
    if histories.targets is None:
        raise RecommendInputError(
            "the split has no held-out targets", "evaluate the valid or test split"
        )
    if len(histories) == 0 or batch_size < 1:
        raise RecommendInputError(
            f"evaluate got {len(histories)} users and batch size {batch_size}",
            "pass at least one user and a batch size >= 1",
        )
    if trie is None:
        trie = item_trie(model)
    k = max(ks)
    ranks, invalid, seconds, passes, batches = [], 0, 0.0, 0, 0
    for part in torch.arange(len(histories)).split(batch_size):
        users = histories.select(part)
        # A time-aware model reads each item's time and the target's (HSTU's protocol)
        times = users.history_times()
        start = time.perf_counter()
        if exclude_history:
            seen_values, seen_offsets, *_ = model.keep_recent(users.values, users.offsets)
            out = decode_excluding(
                decode,
                model,
                users.values,
                users.offsets,
                seen_values,
                seen_offsets,
                k=k,
                trie=trie,
                times=times,
                **options,
            )
        else:
            out = decode(model, users.values, users.offsets, k=k, trie=trie, times=times, **options)
        seconds += time.perf_counter() - start
        invalid += count_invalid(out.items, model.num_items)
        passes += out.stats.target_passes
        batches += 1
        ranks.append(ranks_from_topk(out.items, users.targets))
    metrics = ranking_metrics(torch.cat(ranks), ks, max_k=k)
    return metrics | {
        "users": len(histories),
        "wall_s_per_user": seconds / len(histories),
        "target_passes_per_batch": passes / batches,
        "invalid_items": invalid,
    }


def count_invalid(items: Tensor, num_items: int) -> int:
    """Entries of [B, K] lists that name no catalogue item (-1 pads excepted) or repeat an
    earlier item of their row."""
    real = items >= 0
    outside = int((real & (items >= num_items)).sum())
    ordered = items.sort(dim=1).values
    repeats = int(((ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)).sum())
    return outside + repeats


def format_table(results: dict[str, dict], ks: tuple[int, ...]) -> str:
    names = [f"hr@{k}" for k in ks] + [f"ndcg@{k}" for k in ks] + ["mrr"]
    head = f"{'decoder':<12}" + "".join(f"{n:>10}" for n in names)
    head += f"{'ms/user':>9}{'passes':>8}{'invalid':>8}"
    lines = [head]
    for decoder, r in results.items():
        line = f"{decoder:<12}" + "".join(f"{r[n]:>10.4f}" for n in names)
        line += f"{r['wall_s_per_user'] * 1e3:>9.2f}{r['target_passes_per_batch']:>8.1f}"
        lines.append(line + f"{r['invalid_items']:>8d}")
    return "\n".join(lines)


def evaluate_checkpoint(
    ckpt: Path | str,
    data_dir: Path | str | None,
    config: EvaluateConfig,
    options: dict,  # decoder options, each given to the decoders that take it
    log: Callable[[str], None] = lambda line: None,
) -> tuple[str, dict]:  # (a header line naming what was evaluated, the report)
    """Every decoder of `config` on the same users of a checkpoint's split: the report holds
    ckpt, split, users, options, exclude_history and results (decoder -> `evaluate`'s metrics)."""
    set_threads(config.threads)
    decoders = {name: get_decoder(name) for name in config.decoders}
    check_options(decoders, options)
    for name, decode in decoders.items():
        check_option_values(name, decode, options)
    model, data = load_model_and_data(ckpt, data_dir)
    split = getattr(data, config.split)
    histories = split.select(sample_users(len(split), config.users, config.seed))
    results = {}
    for name, decode in decoders.items():
        start = time.perf_counter()
        results[name] = evaluate(
            model,
            histories,
            decode,
            ks=config.ks,
            batch_size=config.batch_size,
            exclude_history=config.exclude_history,
            **options_for(decode, options),
        )
        log(f"{name}: {len(histories)} users in {time.perf_counter() - start:.0f} s")
    header = (
        f"{data.manifest.get('name', data.path)} {config.split} split, {len(histories)} users, "
        f"full catalogue ({model.num_items} items), lists of {max(config.ks)}"
        + (", history items excluded" if config.exclude_history else "")
        + (f", options {options}" if options else "")
    )
    report = {
        "ckpt": str(ckpt),
        "split": config.split,
        "users": len(histories),
        "options": options,
        "exclude_history": config.exclude_history,
        "results": results,
    }
    return header, report
