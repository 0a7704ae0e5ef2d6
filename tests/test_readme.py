"""The README and docs/ cannot rot: the README's quick start runs, its links resolve, every
`genrec-spec ...` command written in README.md or docs/ names a real subcommand and parses.

The quick start (the README's "## Quick start" section) runs for real, once, in a temporary
folder: each `genrec-spec` line of its ```bash blocks as a subprocess (exit code 0), then its
```python blocks in order, in one namespace. It trains the demo model (a few minutes), so it is
marked slow.
"""

import argparse
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").rglob("*.md"))
MAX_README_LINES = 300

FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
INLINE_COMMAND = re.compile(r"`(genrec-spec [^`]+)`")
SUBCOMMAND = re.compile(r"\bgenrec-spec ([a-z][a-z0-9-]*)(?: ([a-z][a-z0-9-]*))?")
# Placeholders in a documented command (COMMAND, CKPT, N, "...") mark it as a pattern, not a
# command to parse.
PLACEHOLDER = re.compile(r"\.\.\.|(?<![\w./-])[A-Z][A-Z0-9_]*(?![\w./-])")


def section(text: str, heading: str) -> str:
    """The body of the `## heading` section of a markdown text (up to the next `## `)."""
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f"README.md has no '## {heading}' section"
    return match.group(1)


def fenced(text: str, language: str) -> list[str]:
    """The bodies of the fenced code blocks of `language`, in order."""
    return [body for lang, body in FENCE.findall(text) if lang == language]


def shell_lines(block: str) -> list[str]:
    """The commands of a bash block: continuation lines joined, comments and blanks dropped."""
    joined = re.sub(r"\\\n\s*", " ", block)
    lines = (re.sub(r"(^|\s)#.*$", "", line).strip() for line in joined.splitlines())
    return [line for line in lines if line]


def genrec_argv(command: str) -> list[str] | None:
    """The arguments after `genrec-spec` in a shell command (None if it does not run it)."""
    words = shlex.split(command.rstrip("&").strip())
    if "genrec-spec" not in words:
        return None
    return words[words.index("genrec-spec") + 1 :]


def documented_commands() -> list[tuple[str, str]]:
    """(file, command) for every concrete `genrec-spec ...` command in README.md and docs/:
    the lines of ```bash blocks and inline code spans."""
    found = []
    for path in (README, *DOCS):
        text = path.read_text()
        spans = [line for block in fenced(text, "bash") for line in shell_lines(block)]
        spans += INLINE_COMMAND.findall(text)
        for command in spans:
            after = command.partition("genrec-spec")[2]
            if after and not PLACEHOLDER.search(after):
                found.append((str(path.relative_to(ROOT)), command))
    return found


def test_readme_is_short():
    lines = README.read_text().count("\n")
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines; move detail to docs/"


def heading_anchors(path: Path) -> set[str]:
    """The anchors of a markdown page's headings as GitHub makes them: lower case, punctuation
    but hyphens and underscores dropped, spaces as hyphens, "-1", "-2", ... after repeats."""
    anchors, seen = set(), {}
    text = FENCE.sub("", path.read_text())  # (a "# comment" in a code block is no heading)
    for heading in re.findall(r"^#{1,6} (.*)$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        anchors.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


@pytest.mark.parametrize("path", [README, *DOCS], ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    """Every relative link names a file that exists and, into a markdown page, a heading of it
    (results pages are linked by section, and a renamed section broke links silently)."""
    missing = []
    for target in LINK.findall(path.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # a URL
        file, _, anchor = target.partition("#")
        page = path.parent / file if file else path
        if not page.exists():
            missing.append(target)
        elif anchor and page.suffix == ".md" and anchor not in heading_anchors(page):
            missing.append(target)
    assert not missing, f"{path.relative_to(ROOT)} links to missing files or sections: {missing}"


def test_named_subcommands_exist():
    from genrec_spec.cli import COMMANDS
    from genrec_spec.cli.bench import COMMANDS as BENCH

    text = "\n".join(p.read_text() for p in (README, *DOCS))
    named = SUBCOMMAND.findall(text)
    assert named, "no `genrec-spec COMMAND` found in README.md or docs/"
    unknown = {name for name, _ in named if name not in COMMANDS}
    unknown |= {f"bench {sub}" for name, sub in named if name == "bench" and sub not in BENCH}
    # The command-line table names subcommands in its first column.
    table = section(README.read_text(), "Command line")
    rows = [line.split("|")[1] for line in table.splitlines() if line.startswith("| `")]
    for row in rows:
        words = re.findall(r"`([a-z][a-z0-9-]*)", row)
        if words[0] == "bench":
            unknown |= {f"bench {w}" for w in words[1:] if w not in BENCH}
        elif words[0] not in COMMANDS:
            unknown.add(words[0])
    assert not unknown, f"README.md or docs/ name subcommands genrec-spec lacks: {unknown}"


def test_documented_commands_parse():
    """Every concrete command written in README.md or docs/ has options the CLI accepts."""
    from genrec_spec.cli import COMMANDS, add_subcommands

    commands = documented_commands()
    assert len(commands) > 20
    failures = []
    for where, command in commands:
        argv = genrec_argv(command)
        # A bare mention (`genrec-spec generate`) or a --help is not a command line to check.
        if not argv or not any(w.startswith("-") for w in argv) or {"-h", "--help"} & set(argv):
            continue
        parser = argparse.ArgumentParser(prog="genrec-spec")
        try:
            add_subcommands(parser, COMMANDS, argv)
            parser.parse_args(argv)
        except SystemExit:  # argparse has printed why
            failures.append(f"{where}: {command}")
    assert not failures, "documented commands the CLI refuses:\n" + "\n".join(failures)


def test_quick_start_extraction():
    """What the slow test runs: recommender (checkpoint and LLM) and LLM commands, then three
    Python blocks."""
    quick = section(README.read_text(), "Quick start")
    lines = [line for block in fenced(quick, "bash") for line in shell_lines(block)]
    assert all(genrec_argv(line) for line in lines), "a quick-start bash line is not genrec-spec"
    commands = [genrec_argv(line)[0] for line in lines]
    assert commands == ["demo", "recommend", "recommend", "generate", "generate"]
    blocks = fenced(quick, "python")
    assert len(blocks) == 3 and "genrec_spec.generate(" in blocks[0]
    assert "genrec_spec.recommend(" in blocks[1] and "genrec_spec.beam_search(" in blocks[2]
    for block in blocks:
        compile(block, "README.md", "exec")


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_quick_start_runs(tmp_path, monkeypatch):
    """Runs the quick start as a reader would, in a fresh folder (runs/ lands in tmp_path)."""
    quick = section(README.read_text(), "Quick start")
    monkeypatch.chdir(tmp_path)
    cli = "import sys; from genrec_spec.cli import main; sys.exit(main(sys.argv[1:]))"
    printed = {}  # subcommand -> its stdout
    for block in fenced(quick, "bash"):
        for line in shell_lines(block):
            done = subprocess.run(
                [sys.executable, "-c", cli, *genrec_argv(line)],
                cwd=tmp_path,
                capture_output=True,
                text=True,
                timeout=1200,
            )
            assert done.returncode == 0, f"{line}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
            printed[" ".join(genrec_argv(line)[:3])] = done.stdout
    namespace: dict = {"__name__": "__readme__"}
    for block in fenced(quick, "python"):
        exec(compile(block, "README.md", "exec"), namespace)

    # What the demo promises (the same checks as tests/test_demo.py, on the full demo).
    for step in ("prepare", "train", "batch", "replay"):
        assert f"$ genrec-spec {step} " in printed["demo"]
    assert "exactness: identical top-10 lists for 100.0% of users (OK)" in printed["demo"]
    demo = tmp_path / "runs" / "demo"
    rows = pd.read_parquet(demo / "candidates")
    assert len(rows) == rows.user_id.nunique() == 943  # every MovieLens-100K user once
    assert (rows.decoder == "spec_beam").all() and rows.item_ids.map(len).eq(10).all()
    metrics = json.loads((demo / "replay" / "metrics.json").read_text())
    assert metrics["overlap"]["identical_lists"] == 1.0  # spec_beam's lists are beam's
    assert (demo / "replay" / "report.html").stat().st_size > 0
    recs = namespace["recs"]
    assert tuple(recs.items.shape) == (2, 10)
    by_title = printed["recommend --llm smollm2"].splitlines()
    assert "by smollm2" in by_title[0] and len(by_title) == 6  # a header and five titles
    assert printed["generate --num-beams 4"].count("[score ") == 2  # K = 2 sequences, scored
    beams = namespace["beams"]  # three of the four titles, each ending in the turn end
    assert tuple(beams.scores.shape) == (1, 3) and all(len(s) > 1 for s in beams.tolist()[0])
