"""The comparison of two arms' runs: per-event metrics, paired bootstrap statistics, the summary
(metrics.json) and its verdict.

Measured per event: the rank of the target in each arm's top-K list, HR@K, NDCG@K and MRR@K
(`recsys.metrics.per_user_metrics`; MRR over the K-item list), overlap@K = |A ∩ B| / K and
whether the two lists are identical (same items, same order; items whose scores agree within
float rounding, 1e-4, may swap: two decoders scoring one prefix in different trees differ in the
last bits of a log-prob, `spec_beam.same_top_k`). Per batch: wall time and sequential target
passes of each arm (`replay_arms.replay`).

Statistics (`compare`): for every metric a paired cluster bootstrap over users (the same
resampled users for both arms; percentile interval at `confidence`, a seeded `torch.Generator`)
gives each arm's mean over events and the difference B - A. Users, not events, are resampled
because a log holds several events of one user and they are correlated (the same history, the
same taste): resampling events would treat them as independent and give intervals that are too
narrow. Each resample's mean is the ratio of its users' summed metric to their summed event
count; on a split (one event per user) users and events are the same thing. Latency is
bootstrapped over batches (the unit that was timed) for ms per event and B's speedup A time /
B time. A difference is significant when its interval excludes 0.

Shape letters: E events, U users, K list length, NB batches, R bootstrap resamples,
S statistics bootstrapped together.
"""

from __future__ import annotations

from dataclasses import asdict

import torch
from torch import Tensor

from genrec_spec.jobs.replay_arms import Arm, ArmRun, ReplayConfig
from genrec_spec.jobs.replay_events import Events
from genrec_spec.recsys.decoders.spec_beam import same_top_k
from genrec_spec.recsys.metrics import per_user_metrics, ranks_from_topk

# --- per event -----------------------------------------------------------------------------------


def identical_lists(a: ArmRun, b: ArmRun) -> Tensor:  # [E] bool
    """Events whose two lists hold the same items in the same order, or the same list up to
    float rounding (scores within 1e-4, near-exact ties in either order: `same_top_k`)."""
    exact = (a.items == b.items).all(dim=1)
    return exact | same_top_k(a, b)


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


# --- summary -------------------------------------------------------------------------------------


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
