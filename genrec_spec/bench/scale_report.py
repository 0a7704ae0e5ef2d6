"""`bench scale`'s report: its tables as text and markdown, the issue's targets checked against
the smallest size measured, and a plot of latency against catalogue size (matplotlib, where
installed).

Targets (issue 34), each at every size against the smallest: `beam` and `spec_beam` at beam width
200 and batch 1 within 2x of their latency there; `dense` through the index within 2x of its
latency there, at recall@K >= 0.95.
"""

from __future__ import annotations

import io
import json
from dataclasses import asdict
from pathlib import Path

from genrec_spec.bench.scale import Cell
from genrec_spec.data_pipelines.atomic import atomic_write_bytes

TARGET_WIDTH = 200
TARGET_RATIO = 2.0
TARGET_RECALL = 0.95


def _fmt(value, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def _cell(report, decoder: str, width: int | None, batch: int) -> Cell | None:
    key = (decoder, width, batch)
    return next((c for c in report.cells if (c.decoder, c.beam_width, c.batch) == key), None)


def _latency(report, decoder: str, width: int | None, batch: int) -> float | None:
    cell = _cell(report, decoder, width, batch)
    return None if cell is None else cell.latency_ms


def targets(reports: list) -> list[str]:
    """One line per target and size: the ratio to the smallest size, met or not."""
    base, lines = reports[0], []
    for report in reports[1:]:
        for decoder, width in (("beam", TARGET_WIDTH), ("spec_beam", TARGET_WIDTH)):
            lines.append(_ratio_line(base, report, decoder, width, ""))
        extra = f", recall@K {_fmt(report.recall_at_k, '.3f')}"
        line = _ratio_line(base, report, "dense-index", None, extra)
        if report.recall_at_k is not None and report.recall_at_k < TARGET_RECALL:
            line = line.replace(": met", ": NOT met (recall)")
        lines.append(line)
    return lines


def _ratio_line(base, report, decoder: str, width: int | None, extra: str) -> str:
    was, now = _latency(base, decoder, width, 1), _latency(report, decoder, width, 1)
    what = f"{decoder}" + (f" W={width}" if width else "") + f" batch 1 at {report.items:,}"
    if was is None or now is None:
        return f"{what}: not measured"
    ratio = now / was
    verdict = "met" if ratio <= TARGET_RATIO else "NOT met"
    return f"{what}: {ratio:.2f}x its latency at {base.items:,}{extra}: {verdict}"


def size_rows(reports: list) -> list[list[str]]:
    rows = [
        [
            "items",
            "levels",
            "prepare s",
            "prepare peak GiB",
            "trie build ms",
            "trie B/item",
            "model MiB",
            "index build s",
            "recall@K",
        ]
    ]
    for r in reports:
        peak = r.prepare.peak_rss_bytes
        rows.append(
            [
                f"{r.items:,}",
                str(r.levels),
                f"{r.prepare.wall_s:.1f}" + ("" if r.prepare.measured else " (reused)"),
                _fmt(None if peak is None else peak / 2**30),
                f"{r.trie_build_s * 1e3:.1f}",
                f"{r.trie_bytes_per_item:.1f}",
                f"{r.model_bytes / 2**20:.1f}",
                _fmt(r.index_build_s, ".1f"),
                _fmt(r.recall_at_k, ".3f"),
            ]
        )
    return rows


def latency_rows(reports: list) -> list[list[str]]:
    """decoder, width, batch, then latency ms (users/s) per size."""
    keys = list(dict.fromkeys((c.decoder, c.beam_width, c.batch) for r in reports for c in r.cells))
    rows = [["decoder", "W", "batch", *(f"{r.items:,} ms (users/s)" for r in reports)]]
    for decoder, width, batch in keys:
        row = [decoder, _fmt(width, "d"), str(batch)]
        for r in reports:
            cell = _cell(r, decoder, width, batch)
            if cell is None or cell.latency_ms is None:
                row.append("-" if cell is None else cell.note)
            else:
                row.append(
                    f"{cell.latency_ms:.2f} ({cell.users_per_s:.0f})" + ("*" if cell.note else "")
                )
        rows.append(row)
    return rows


def _text_table(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)) for row in rows
    )


def _markdown_table(rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows[1:]])


def _one_call(reports: list) -> bool:
    """Whether a latency shown comes from one call (a cell marked *)."""
    return any(c.note and c.latency_ms is not None for r in reports for c in r.cells)


def format_text(header: str, reports: list) -> str:
    parts = [header, _text_table(size_rows(reports)), _text_table(latency_rows(reports))]
    if _one_call(reports):
        parts.append("* one call only (the first two were too slow to repeat)")
    return "\n\n".join(parts + ["targets:\n  " + "\n  ".join(targets(reports))])


def format_markdown(header: str, reports: list) -> str:
    parts = [header, _markdown_table(size_rows(reports)), _markdown_table(latency_rows(reports))]
    if _one_call(reports):
        parts.append("\\* one call only (the first two were too slow to repeat)")
    return "\n\n".join(parts + ["Targets:\n\n- " + "\n- ".join(targets(reports))]) + "\n"


def plot(reports: list, path: Path) -> bool:
    """Latency at batch 1 against catalogue size, one line per decoder and width; False where
    matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    keys = dict.fromkeys(
        (c.decoder, c.beam_width) for r in reports for c in r.cells if c.batch == 1
    )
    figure, axes = plt.subplots(figsize=(7, 4.5))
    for decoder, width in keys:
        points = [(r.items, _latency(r, decoder, width, 1)) for r in reports]
        points = [(x, y) for x, y in points if y is not None]
        if points:
            label = decoder + (f" W={width}" if width else "")
            axes.plot(*zip(*points, strict=True), marker="o", label=label)
    axes.set(xscale="log", yscale="log", xlabel="catalogue items", ylabel="latency, batch 1 (ms)")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize=7, ncol=2)
    figure.tight_layout()
    image = io.BytesIO()
    figure.savefig(image, format="png", dpi=120)
    plt.close(figure)
    atomic_write_bytes(path, image.getvalue())
    return True


def write(header: str, reports: list, settings, out: Path) -> list[Path]:
    """scale.json, scale.md and (with matplotlib) scale.png in `out`; the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    report = {"settings": asdict(settings), "header": header, "sizes": [asdict(r) for r in reports]}
    # (each file replaced whole: the report is rewritten after every size)
    atomic_write_bytes(out / "scale.json", (json.dumps(report, indent=1) + "\n").encode())
    atomic_write_bytes(out / "scale.md", format_markdown(header, reports).encode())
    written = [out / "scale.json", out / "scale.md"]
    return written + ([out / "scale.png"] if plot(reports, out / "scale.png") else [])
