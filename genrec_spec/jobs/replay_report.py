"""The replay's output files: ``report.html``, ``metrics.json`` and ``per_user.parquet``.

``report.html`` is self-contained: its plots are matplotlib PNGs embedded as base64 data URIs and
its style sheet is inline, so it opens offline and names no external URL. It shows the verdict,
each metric of both arms with its bootstrap interval next to the paired difference B - A, the
latency distributions of both arms (per batch, and over the replay in time order), the
overlap@K histogram, and tables of every number.

``metrics.json`` is `ReplayResult.summary` plus the command line. ``per_user.parquet`` has one
row per event (one per user on a split), in replay order: event, user_id, timestamp (null
without one), target (raw item id), history_length (items before the event; the models read the
most recent max_len of them), batch, a_items / b_items (raw item ids, best first), then per arm
rank (0 = missed), hit (HR@K), ndcg (NDCG@K), rr (reciprocal rank, MRR@K) and latency_ms (the
event's share of its batch's wall time), and overlap (overlap@K) and identical (same items in
the same order).
"""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from genrec_spec.data_pipelines.atomic import atomic_dir
from genrec_spec.jobs.replay import ReplayResult, run_replay
from genrec_spec.jobs.replay_arms import Arm, ReplayConfig
from genrec_spec.jobs.replay_compare import arm_text
from genrec_spec.machine import set_threads

FILES = ("report.html", "metrics.json", "per_user.parquet")
COLORS = {"A": "#4c72b0", "B": "#dd8452"}
STYLE = """
body { font-family: sans-serif; max-width: 1100px; margin: 2em auto; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; }
td, th { border: 1px solid #bbb; padding: 0.25em 0.6em; text-align: right; }
th { background: #eee; } td:first-child, th:first-child { text-align: left; }
pre { background: #f6f6f6; padding: 0.8em; overflow-x: auto; }
img { max-width: 100%; }
"""


def replay_to_folder(
    arm_a: Arm,
    arm_b: Arm,
    config: ReplayConfig,
    out: Path,
    command: str,  # the command line that reproduces the run, kept in the report
    *,
    overwrite: bool = False,
    split: str | None = None,
    log: Path | None = None,
    data_dir: Path | None = None,
    threads: int = 1,  # torch CPU threads
) -> ReplayResult:
    """Run the replay (`run_replay`) and write its three files into `out`, atomically: nothing
    is left there on failure."""
    set_threads(threads)
    with atomic_dir(out, overwrite=overwrite) as tmp:
        result = run_replay(arm_a, arm_b, config, split=split, log=log, data_dir=data_dir)
        write_report(result, tmp, command)
    return result


def write_report(result: ReplayResult, folder: Path, command: str) -> None:
    """Write the three files into `folder` (the caller's temporary output folder)."""
    folder = Path(folder)
    metrics = result.summary | {"command": command}
    (folder / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    per_event_frame(result).to_parquet(folder / "per_user.parquet", index=False)
    (folder / "report.html").write_text(render_html(result, command))


def per_event_frame(result: ReplayResult) -> pd.DataFrame:
    """One row per event (module docstring)."""
    events, columns = result.events.histories, result.per_event
    k = result.summary["replay"]["k"]
    ids = np.asarray(result.item_ids, dtype=object)
    times = result.events.timestamps
    frame = {
        "event": np.arange(len(events)),
        "user_id": events.user_ids,
        "timestamp": pd.array(
            [None] * len(events) if times is None else times.numpy(), dtype="Int64"
        ),
        "target": ids[events.targets.numpy()],
        "history_length": result.events.history_lengths.numpy(),
        "batch": columns["batch"].numpy(),
    }
    for side, run in zip("ab", result.runs, strict=True):
        frame[f"{side}_items"] = [list(ids[row[row >= 0]]) for row in run.items.numpy()]
    for side in "ab":
        frame[f"{side}_rank"] = columns[f"{side}_rank"].numpy()
        frame[f"{side}_hit"] = columns[f"{side}_hr@{k}"].numpy()
        frame[f"{side}_ndcg"] = columns[f"{side}_ndcg@{k}"].numpy()
        frame[f"{side}_rr"] = columns[f"{side}_mrr@{k}"].numpy()
    frame["overlap"] = columns["overlap"].numpy()
    frame["identical"] = columns["identical"].numpy()
    for side in "ab":
        frame[f"{side}_latency_ms"] = columns[f"{side}_latency_ms"].numpy()
    return pd.DataFrame(frame)


# --- figures -------------------------------------------------------------------------------------


def metrics_figure(summary: dict) -> Figure:
    """Left: each arm's mean with its interval; right: the paired difference B - A."""
    diffs = summary["differences"]
    names = list(diffs)
    fig = Figure(figsize=(11, 3.8), layout="constrained")
    bars, delta = fig.subplots(1, 2, width_ratios=(3, 2))
    x = np.arange(len(names))
    for offset, side in ((-0.2, "A"), (0.2, "B")):
        s = side.lower()
        mean = np.array([diffs[n][s] for n in names])
        err = np.array(
            [
                [diffs[n][s] - diffs[n][f"{s}_low"], diffs[n][f"{s}_high"] - diffs[n][s]]
                for n in names
            ]
        ).T
        bars.bar(x + offset, mean, 0.4, yerr=err, capsize=4, color=COLORS[side], label=side)
    bars.set_xticks(x, names)
    bars.set_title(f"each arm, {round(100 * summary['replay']['confidence'])}% interval")
    bars.legend()
    mean = np.array([diffs[n]["diff"] for n in names])
    err = np.array(
        [[diffs[n]["diff"] - diffs[n]["low"], diffs[n]["high"] - diffs[n]["diff"]] for n in names]
    ).T
    delta.errorbar(mean, x, xerr=err, fmt="o", capsize=4, color="#333")
    delta.axvline(0, color="#999", linestyle="--")
    delta.set_yticks(x, names)
    delta.invert_yaxis()
    delta.set_title("paired difference B - A")
    return fig


def latency_figure(result: ReplayResult) -> Figure:
    """Left: distribution of per-batch ms per event; right: the same over the replay."""
    sizes = np.diff(result.batch_offsets.numpy())
    per_event = {
        side: run.batch_seconds.numpy() / sizes * 1e3
        for side, run in zip("AB", result.runs, strict=True)
    }
    fig = Figure(figsize=(11, 3.6), layout="constrained")
    hist, trace = fig.subplots(1, 2)
    edges = np.histogram_bin_edges(np.concatenate(list(per_event.values())), bins=30)
    for side, ms in per_event.items():
        hist.hist(ms, bins=edges, alpha=0.6, color=COLORS[side], label=side)
        trace.plot(ms, marker=".", color=COLORS[side], label=side)
    hist.set_xlabel("ms per event (batch wall time / batch size)")
    hist.set_ylabel("batches")
    hist.yaxis.set_major_locator(MaxNLocator(integer=True))
    hist.legend()
    trace.set_xlabel("batch (replay order)")
    trace.xaxis.set_major_locator(MaxNLocator(integer=True))
    trace.set_ylabel("ms per event")
    trace.legend()
    return fig


def overlap_figure(overlap: np.ndarray, k: int, unit: str) -> Figure:  # overlap: [E] float64
    """Histogram of overlap@K, whose values are j / K."""
    counts = np.bincount(np.rint(overlap * k).astype(int), minlength=k + 1)
    fig = Figure(figsize=(6, 3.2), layout="constrained")
    ax = fig.subplots()
    ax.bar(np.arange(k + 1) / k, counts, width=0.8 / k, color="#55a868")
    ax.set_xlabel(f"overlap@{k} = |A ∩ B| / {k}")
    ax.set_ylabel(unit)
    return fig


def png_data_uri(fig: Figure) -> str:
    buffer = io.BytesIO()
    # No "Software" text chunk: it would carry matplotlib's web address into the file.
    fig.savefig(buffer, format="png", dpi=100, metadata={"Software": None})
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


# --- html ----------------------------------------------------------------------------------------


def table(header: list[str], rows: list[list]) -> str:
    cells = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in rows
    )
    return f"<table><tr>{cells}</tr>{body}</table>"


def _ci(mean: float, low: float, high: float, digits: int = 4, sign: str = "") -> str:
    return f"{mean:{sign}.{digits}f} [{low:{sign}.{digits}f}, {high:{sign}.{digits}f}]"


def render_html(result: ReplayResult, command: str) -> str:
    s = result.summary
    r, arms, lat = s["replay"], s["arms"], s["latency"]
    unit = "users" if result.events.is_split else "events"
    pct = round(100 * r["confidence"])
    quality = table(
        ["metric", f"A [{pct}% CI]", f"B [{pct}% CI]", f"B - A [{pct}% CI]", "significant"],
        [
            [
                name,
                _ci(d["a"], d["a_low"], d["a_high"]),
                _ci(d["b"], d["b_low"], d["b_high"]),
                _ci(d["diff"], d["low"], d["high"], sign="+"),
                "yes" if d["significant"] else "no",
            ]
            for name, d in s["differences"].items()
        ],
    )
    speed_keys = ["ms_per_event", "ms_per_batch_p50", "ms_per_batch_p90", "ms_per_batch_p99"]
    speed = table(
        ["arm", *speed_keys, "total_s", "target_passes_per_batch", "invalid_items"],
        [
            [side]
            + [f"{arms[side][key]:.3f}" for key in [*speed_keys, "total_s"]]
            + [f"{arms[side]['target_passes_per_batch']:.2f}", arms[side]["invalid_items"]]
            for side in "AB"
        ],
    )
    speed += table(
        [f"B - A ms/event [{pct}% CI]", f"speedup of B = A time / B time [{pct}% CI]"],
        [
            [
                _ci(lat["diff_ms_per_event"], lat["low"], lat["high"], 3, "+"),
                _ci(lat["speedup_of_b"], lat["speedup_low"], lat["speedup_high"], 3),
            ]
        ],
    )
    overlap = table(["", "value"], [[name, f"{value:.4f}"] for name, value in s["overlap"].items()])
    setup = table(
        ["setting", "value"],
        [["A", arm_text(arms["A"])], ["B", arm_text(arms["B"])]]
        + [[key, value] for key, value in r.items()]
        + [["command", command]],
    )
    overlap_png = png_data_uri(overlap_figure(result.per_event["overlap"].numpy(), r["k"], unit))
    sections = [
        "<h1>Offline A/B replay</h1>",
        f"<p>A = {html.escape(arm_text(arms['A']))}<br>B = {html.escape(arm_text(arms['B']))}"
        f"<br>{r['events']} events of {r['users']} users ({html.escape(r['source'])}), "
        f"top-{r['k']} lists, {r['bootstrap']} paired bootstrap resamples of users</p>",
        "<h2>Verdict</h2>",
        f"<pre>{html.escape(chr(10).join(s['verdict']))}</pre>",
        "<h2>Ranking quality</h2>",
        f'<img alt="metrics" src="{png_data_uri(metrics_figure(s))}">',
        quality,
        "<h2>Latency</h2>",
        f'<img alt="latency" src="{png_data_uri(latency_figure(result))}">',
        speed,
        "<h2>List overlap</h2>",
        f'<img alt="overlap" src="{overlap_png}">',
        overlap,
        "<h2>Setup</h2>",
        setup,
    ]
    return (
        '<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>genrec-spec replay</title><style>{STYLE}</style></head><body>\n"
        + "\n".join(sections)
        + "\n</body></html>\n"
    )
