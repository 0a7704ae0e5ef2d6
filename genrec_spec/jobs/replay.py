"""Offline A/B replay of two recommendation arms with paired bootstrap statistics.

An arm is a decoder with its options on a checkpoint (`Arm`, parsed from
``"decoder=beam,beam_width=20"``). Both arms decode the same events, in time order, in the same
batches, and every difference B - A is measured on those paired events.

Events come from a split or a log (`replay_events`).

Measured per event: the rank of the target in each arm's top-K list, HR@K, NDCG@K and MRR@K
(`recsys.metrics.per_user_metrics`; MRR over the K-item list), overlap@K = |A ∩ B| / K and
whether the two lists are identical (same items, same order; items whose scores agree within
float rounding, 1e-4, may swap: two decoders scoring one prefix in different trees differ in the
last bits of a log-prob, `spec_beam.same_top_k`). Per batch: wall time and
sequential target passes of each arm. Timing is fair to both arms: the first batch is decoded
once per arm untimed (warm-up), and the arm that goes first alternates from batch to batch.

Statistics (`compare`): for every metric a paired cluster bootstrap over users (the same
resampled users for both arms; percentile interval at `confidence`, a seeded `torch.Generator`)
gives each arm's mean over events and the difference B - A. Users, not events, are resampled
because a log holds several events of one user and they are correlated (the same history, the
same taste): resampling events would treat them as independent and give intervals that are too
narrow. Each resample's mean is the ratio of its users' summed metric to their summed event
count; on a split (one event per user) users and events are the same thing. Latency is
bootstrapped over batches (the unit that was timed) for ms per event and B's speedup A time /
B time. A difference is significant when its interval excludes 0.

Shape letters: E events, U users, M history items, K list length, NB batches, R bootstrap
resamples, S statistics bootstrapped together.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor

from genrec_spec.jobs.errors import ReplayInputError
from genrec_spec.jobs.replay_events import Events, log_events, read_log, split_events
from genrec_spec.recsys.checkpoint import load_checkpoint, load_model_and_data
from genrec_spec.recsys.data import Histories
from genrec_spec.recsys.decoders.beam import item_trie
from genrec_spec.recsys.decoders.registry import decoder_options, get_decoder, parse_option
from genrec_spec.recsys.decoders.spec_beam import same_top_k
from genrec_spec.recsys.evaluate import count_invalid
from genrec_spec.recsys.metrics import per_user_metrics, ranks_from_topk
from genrec_spec.recsys.types import Recommendations

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
    parameters = inspect.signature(decode).parameters
    settable = [n for n in decoder_options(decode) if "Tensor" not in str(parameters[n].annotation)]
    unknown = [name for name in fields if name not in settable]
    if unknown:
        raise ReplayInputError(
            f"{flag} {text!r}: decoder {decoder!r} takes no option {unknown[0]!r}",
            f"use one of its options: {', '.join(settable) or 'none'}",
        )
    options = dict(parse_option(f"{name}={value}") for name, value in fields.items())
    return Arm(decoder, options, Path(ckpt))


# --- replay --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ArmRun:
    """What one arm did on every event."""

    items: Tensor  # [E, K] int64 item indices, best first; -1 pads
    scores: Tensor  # [E, K] float the decoder's scores of those items; -inf pads
    batch_seconds: Tensor  # [NB] float64 wall time of each batch
    batch_passes: Tensor  # [NB] float64 sequential target passes of each batch
    invalid_items: int  # list entries outside the catalogue or repeated (0 for a correct decoder)


@torch.no_grad()
def replay(
    models: tuple, arms: tuple[Arm, Arm], events: Events, k: int, batch_size: int
) -> tuple[ArmRun, ArmRun, Tensor]:  # A, B, batch_offsets [NB+1] int64
    """Both arms over the same batches of consecutive events (module docstring: timing)."""
    decoders = [get_decoder(arm.decoder) for arm in arms]

    def decode(side: int, part: Histories):
        model = models[side]
        return decoders[side](
            model, part.values, part.offsets, k=k, trie=item_trie(model), **arms[side].options
        )

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
            passes[side].append(out.stats.get("target_passes", 0))
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


def identical_lists(a: ArmRun, b: ArmRun) -> Tensor:  # [E] bool
    """Events whose two lists hold the same items in the same order, or the same list up to
    float rounding (scores within 1e-4, near-exact ties in either order: `same_top_k`)."""
    exact = (a.items == b.items).all(dim=1)
    rounded = same_top_k(
        Recommendations(a.items, a.scores, {}), Recommendations(b.items, b.scores, {})
    )
    return exact | rounded


def metric_names(k: int) -> list[str]:
    return [f"hr@{k}", f"ndcg@{k}", f"mrr@{k}"]


def arm_metrics(
    items: Tensor,  # [E, K] int64
    targets: Tensor,  # [E] int64
) -> dict[str, Tensor]:  # rank [E] int64 (0 = missed), hr@K / ndcg@K / mrr@K [E] float64
    ranks = ranks_from_topk(items, targets)
    k = items.shape[1]
    scores = per_user_metrics(ranks, (k,), max_k=k)  # its "mrr" runs over the K-item list
    hr, ndcg, mrr = metric_names(k)
    return {"rank": ranks, hr: scores[hr], ndcg: scores[ndcg], mrr: scores["mrr"]}


def overlap_at_k(
    a: Tensor,  # [E, K] int64 arm A's lists; -1 pads
    b: Tensor,  # [E, K] int64 arm B's lists
) -> Tensor:  # [E] float64 |A ∩ B| / K (pads are no items)
    shared = ((a[:, :, None] == b[:, None, :]) & (a[:, :, None] >= 0)).any(dim=2)  # [E, K]
    return shared.sum(dim=1).double() / a.shape[1]


# --- statistics ----------------------------------------------------------------------------------


def bootstrap_means(
    values: Tensor,  # [S, U] float64, U paired units (users or batches)
    resamples: int,
    generator: torch.Generator,
) -> Tensor:  # [S, R] mean of each row over R resamples
    """Means over resamples of the U units drawn with replacement; every row uses the same
    draw, so paired rows (A, B, B - A) stay paired."""
    units = values.shape[1]
    chunk = max(1, 2**22 // units)  # bounds the [chunk, U] draw in memory
    means = []
    for start in range(0, resamples, chunk):
        draw = torch.randint(units, (min(chunk, resamples - start), units), generator=generator)
        counts = torch.zeros(draw.shape, dtype=values.dtype).scatter_add_(
            1, draw, torch.ones(draw.shape, dtype=values.dtype)
        )  # [chunk, U] times each unit was drawn
        means.append(values @ counts.T / units)
    return torch.cat(means, dim=1)


def interval(
    samples: Tensor,  # [S, R] bootstrap replicates
    confidence: float,
) -> tuple[Tensor, Tensor]:  # low [S], high [S]: the percentile interval
    tails = torch.tensor([(1 - confidence) / 2, (1 + confidence) / 2], dtype=samples.dtype)
    low, high = torch.quantile(samples, tails, dim=1)
    return low, high


def user_index(user_ids: list[str]) -> Tensor:  # [E] int64
    """Each event's user as 0, 1, ... in order of first appearance: with one event per user this
    is 0..E-1, so the cluster bootstrap draws exactly what an event bootstrap would."""
    first: dict[str, int] = {}
    return torch.tensor([first.setdefault(u, len(first)) for u in user_ids], dtype=torch.long)


def metric_differences(
    a: Tensor,  # [S, E] float64 per-event metrics of arm A
    b: Tensor,  # [S, E] float64 the same metrics of arm B
    names: list[str],  # [S]
    config: ReplayConfig,
    generator: torch.Generator,
    users: Tensor | None = None,  # [E] int64 `user_index` of each event; None: one user each
) -> dict[str, dict]:
    """Each metric's means and intervals for A, B and B - A, from one paired resampling of users
    (module docstring): per-user sums and event counts are resampled together, and each
    replicate is a ratio of resampled sums, so users with more events weigh more, as in the
    mean over events."""
    rows = torch.cat([a, b, b - a])  # [3S, E]
    if users is None:
        users = torch.arange(rows.shape[1])
    sums = rows.new_zeros(len(rows), int(users.max()) + 1).index_add_(1, users, rows)  # [3S, U]
    counts = torch.bincount(users).to(rows.dtype)  # [U] events of each user
    replicates = bootstrap_means(torch.cat([sums, counts[None]]), config.bootstrap, generator)
    replicates = replicates[:-1] / replicates[-1]  # [3S, R]
    low, high = (x.view(3, len(names)) for x in interval(replicates, config.confidence))
    out = {}
    for i, name in enumerate(names):
        mean = [float(a[i].mean()), float(b[i].mean()), float((b[i] - a[i]).mean())]
        out[name] = {
            "a": mean[0],
            "a_low": float(low[0, i]),
            "a_high": float(high[0, i]),
            "b": mean[1],
            "b_low": float(low[1, i]),
            "b_high": float(high[1, i]),
            "diff": mean[2],
            "low": float(low[2, i]),
            "high": float(high[2, i]),
            "significant": bool(low[2, i] > 0 or high[2, i] < 0),
        }
    return out


def latency_difference(
    seconds_a: Tensor,  # [NB] float64 arm A's wall time per batch
    seconds_b: Tensor,  # [NB] float64
    sizes: Tensor,  # [NB] float64 events per batch
    config: ReplayConfig,
    generator: torch.Generator,
) -> dict:
    """B - A in ms per event and B's speedup (A time / B time; > 1: B is faster), resampling
    batches."""
    boot = bootstrap_means(torch.stack([seconds_a, seconds_b, sizes]), config.bootstrap, generator)
    diff_ms = (boot[1] - boot[0]) / boot[2] * 1e3  # [R]
    low, high = interval(torch.stack([diff_ms, boot[0] / boot[1]]), config.confidence)
    return {
        "diff_ms_per_event": float((seconds_b.sum() - seconds_a.sum()) / sizes.sum() * 1e3),
        "low": float(low[0]),
        "high": float(high[0]),
        "significant": bool(low[0] > 0 or high[0] < 0),
        "speedup_of_b": float(seconds_a.sum() / seconds_b.sum()),
        "speedup_low": float(low[1]),
        "speedup_high": float(high[1]),
    }


def compare(
    events: Events,
    arms: tuple[Arm, Arm],
    runs: tuple[ArmRun, ArmRun],
    batch_offsets: Tensor,  # [NB+1] int64
    config: ReplayConfig,
) -> tuple[dict, dict[str, Tensor]]:
    """(summary for metrics.json, per-event columns, [E] each) of a finished replay."""
    generator = torch.Generator().manual_seed(config.seed)
    sizes = (batch_offsets[1:] - batch_offsets[:-1]).double()  # [NB]
    per_event = {"batch": torch.repeat_interleave(torch.arange(len(sizes)), sizes.long())}
    for side, run in zip("ab", runs, strict=True):
        for name, value in arm_metrics(run.items, events.histories.targets).items():
            per_event[f"{side}_{name}"] = value
        # each event's share of its batch's wall time
        share = run.batch_seconds / sizes * 1e3  # [NB]
        per_event[f"{side}_latency_ms"] = torch.repeat_interleave(share, sizes.long())
    per_event["overlap"] = overlap_at_k(runs[0].items, runs[1].items)
    per_event["identical"] = identical_lists(*runs)

    names = metric_names(config.k)
    a = torch.stack([per_event[f"a_{n}"] for n in names])  # [S, E]
    b = torch.stack([per_event[f"b_{n}"] for n in names])  # [S, E]
    users = user_index(events.histories.user_ids)
    differences = metric_differences(a, b, names, config, generator, users)
    settings = asdict(config)
    # The config's `users` is the size of the user sample asked for (0: all); it must not
    # overwrite the count of users replayed.
    settings["user_sample"] = settings.pop("users")
    summary = {
        "replay": {
            "source": events.source,
            "events": len(events.histories),
            "users": len(set(events.histories.user_ids)),
            "batches": len(sizes),
        }
        | settings,
        "arms": {
            side: arm_summary(arm, run, sizes, {n: differences[n][side.lower()] for n in names})
            for side, arm, run in zip("AB", arms, runs, strict=True)
        },
        "differences": differences,
        "latency": latency_difference(
            runs[0].batch_seconds, runs[1].batch_seconds, sizes, config, generator
        ),
        "overlap": {
            f"mean_overlap@{config.k}": float(per_event["overlap"].mean()),
            "identical_lists": float(per_event["identical"].double().mean()),
        },
    }
    summary["verdict"] = verdict(summary, events.is_split)
    return summary, per_event


def arm_summary(
    arm: Arm,
    run: ArmRun,
    sizes: Tensor,  # [NB] float64 events per batch
    metrics: dict[str, float],  # the arm's mean metrics
) -> dict:
    """One arm's settings, mean metrics, latency, passes and invalid items."""
    per_batch_ms = run.batch_seconds * 1e3  # [NB]
    q = torch.quantile(per_batch_ms, torch.tensor([0.5, 0.9, 0.99], dtype=torch.float64))
    return {
        "decoder": arm.decoder,
        "options": arm.options,
        "ckpt": str(arm.ckpt),
        "metrics": metrics,
        "ms_per_event": float(run.batch_seconds.sum() / sizes.sum() * 1e3),
        "ms_per_batch_p50": float(q[0]),
        "ms_per_batch_p90": float(q[1]),
        "ms_per_batch_p99": float(q[2]),
        "total_s": float(run.batch_seconds.sum()),
        "target_passes_per_batch": float(run.batch_passes.mean()),
        "invalid_items": run.invalid_items,
    }


def verdict(summary: dict, per_user: bool) -> list[str]:
    """Short human verdict: each metric's difference with its interval, latency, list overlap."""
    r, arms = summary["replay"], summary["arms"]
    unit = "users" if per_user else "events"
    pct = round(100 * r["confidence"])
    lines = [
        f"replay of {r['events']} events of {r['users']} users ({r['source']}), K={r['k']}, "
        f"{pct}% paired bootstrap intervals over users ({r['bootstrap']} resamples)",
        f"  A = {arm_text(arms['A'])}",
        f"  B = {arm_text(arms['B'])}",
    ]
    wins: dict[str, list[str]] = {"A": [], "B": [], "none": []}
    for name, d in summary["differences"].items():
        winner = ("B" if d["diff"] > 0 else "A") if d["significant"] else "none"
        wins[winner].append(name)
        said = f"{winner} wins" if d["significant"] else "no significant difference"
        lines.append(
            f"  {name:<9} A {d['a']:.4f}  B {d['b']:.4f}  B-A {d['diff']:+.4f} "
            f"[{d['low']:+.4f}, {d['high']:+.4f}]  {said}"
        )
    lat = summary["latency"]
    winner = ("A" if lat["diff_ms_per_event"] > 0 else "B") if lat["significant"] else "none"
    wins[winner].append("latency")
    if winner == "none":
        said = "no significant difference"
    else:  # the faster arm's factor, with its interval
        speedup = (lat["speedup_of_b"], lat["speedup_low"], lat["speedup_high"])
        factor, low, high = speedup if winner == "B" else [1 / x for x in speedup]
        said = f"{winner} is {factor:.2f}x faster [{min(low, high):.2f}, {max(low, high):.2f}]"
    lines.append(
        f"  latency   A {arms['A']['ms_per_event']:.3f}  B {arms['B']['ms_per_event']:.3f} "
        f"ms/event  B-A {lat['diff_ms_per_event']:+.3f} [{lat['low']:+.3f}, {lat['high']:+.3f}]"
        f"  {said}"
        + (f" (only {r['batches']} batches timed: a rough interval)" if r["batches"] < 10 else "")
    )
    identical = summary["overlap"]["identical_lists"]
    overlap = summary["overlap"][f"mean_overlap@{r['k']}"]
    lines.append(
        f"  lists     identical lists for {100 * identical:.1f}% of {unit}; "
        f"mean overlap@{r['k']} {overlap:.3f}"
    )
    said = [f"{side} wins on {', '.join(wins[side])}" for side in "AB" if wins[side]]
    if wins["none"]:
        said.append(f"no significant difference on {', '.join(wins['none'])}")
    lines.append("verdict: " + "; ".join(said))
    return lines


def arm_text(arm: dict) -> str:
    """An arm of metrics.json as the --a / --b text that makes it, and its checkpoint."""
    options = "".join(f",{n}={v}" for n, v in arm["options"].items())
    return f"decoder={arm['decoder']}{options} on {arm['ckpt']}"


# --- the whole job -------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReplayResult:
    """Everything `replay_report` writes."""

    events: Events
    arms: tuple[Arm, Arm]
    runs: tuple[ArmRun, ArmRun]
    batch_offsets: Tensor  # [NB+1] int64 events of each batch
    item_ids: list[str]  # [I] raw id of each item index
    summary: dict  # metrics.json
    per_event: dict[str, Tensor]  # column name -> [E]


def run_replay(
    arm_a: Arm,
    arm_b: Arm,
    config: ReplayConfig,
    *,
    split: str | None = None,
    log: Path | None = None,
    data_dir: Path | None = None,  # prepared data; default: the one A was trained on
) -> ReplayResult:
    """Load both arms' models and the events (exactly one of split / log), replay, compare."""
    if (split is None) == (log is None):
        raise ReplayInputError(
            "replay needs exactly one event source", "give a split or a log file, not both"
        )
    model_a, data = load_model_and_data(arm_a.ckpt, data_dir)
    model_b = model_a
    if Path(arm_b.ckpt).resolve() != Path(arm_a.ckpt).resolve():
        model_b, manifest = load_checkpoint(arm_b.ckpt)
        trained_on = manifest.get("data", {}).get("data_hash")
        if trained_on != data.data_hash:
            raise ReplayInputError(
                f"--ckpt-b {arm_b.ckpt} was trained on data {trained_on} but --ckpt "
                f"{arm_a.ckpt} on data {data.data_hash} ({data.path}); an A/B replay compares "
                "models of the same data",
                "pass two checkpoints trained on one prepared folder",
            )
    if not config.k <= model_a.num_items:
        raise ReplayInputError(
            f"--k {config.k} exceeds the catalogue ({model_a.num_items} items)",
            f"ask for at most {model_a.num_items} items",
        )
    if split is not None:
        events = split_events(data, split, config.users, config.seed)
    else:
        keep = max(model_a.config.max_len, model_b.config.max_len)
        events = log_events(data, read_log(log), config.users, config.seed, keep, f"log {log}")
    if len(events.histories) == 0:
        raise ReplayInputError(
            f"the {events.source} has no events to replay", "replay a split or log with events"
        )
    arms = (arm_a, arm_b)
    run_a, run_b, batch_offsets = replay(
        (model_a, model_b), arms, events, config.k, config.batch_size
    )
    summary, per_event = compare(events, arms, (run_a, run_b), batch_offsets, config)
    summary["replay"] |= {"data": str(data.path), "data_hash": data.data_hash}
    return ReplayResult(
        events, arms, (run_a, run_b), batch_offsets, data.item_ids, summary, per_event
    )
