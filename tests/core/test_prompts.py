"""Prompt corpora: HumanEval from the installed wheel, Debian fortunes, the standard library's
functions, prompt files; the held-out bench / train split is disjoint, covers the corpus and is
deterministic; chat formatting."""

import json

import pytest

from genrec_spec.llm.prompts import (
    PromptConfig,
    PromptError,
    fortune_prompts,
    humaneval_prompts,
    in_bench_split,
    load_prompts,
    source_and_count,
    stdlib_prompts,
)


def test_humaneval_split_disjoint_and_deterministic():
    everything = humaneval_prompts()
    assert len(everything) == 164 and everything[0].startswith("from typing import List")
    bench = load_prompts("humaneval", split="bench")
    train = load_prompts("humaneval", split="train")
    assert not set(bench) & set(train)
    assert sorted(bench + train) == sorted(everything)
    assert 20 <= len(bench) <= 60  # about bench_fraction of 164
    # The split follows the text alone: the same for any seed and n; the seed picks the order.
    assert load_prompts("humaneval", split="bench") == bench
    five = load_prompts("humaneval", n=5, seed=1)
    assert len(five) == 5 and set(five) <= set(bench)
    assert five == load_prompts("humaneval", n=5, seed=1)
    assert five != load_prompts("humaneval", n=5, seed=2)
    assert all(in_bench_split(p) for p in five)
    with pytest.raises(PromptError, match="fewer than n"):
        load_prompts("humaneval", n=len(bench) + 1)
    with pytest.raises(PromptError, match="split"):
        load_prompts("humaneval", split="test")


def test_fortune_files_parsed(tmp_path):
    (tmp_path / "people").write_text(
        "Too short.\n%\nA passage that is long enough to be a prompt, with\na second line.\n%\n"
        "Some _\bu_\bn_\bd_\be_\br_\bl_\bi_\bn_\be_\bd words inside a longer passage here.\n%\n"
    )
    (tmp_path / "people.dat").write_bytes(b"\x00\x01 binary index")
    (tmp_path / "work").write_text(
        "A passage that is long enough to be a prompt, with\na second line.\n%\n"  # duplicate
        "Work expands so as to fill the time available for its completion.\n"
    )
    passages = fortune_prompts(PromptConfig(fortunes_dir=tmp_path))
    assert passages == [
        "A passage that is long enough to be a prompt, with\na second line.",
        "Some underlined words inside a longer passage here.",
        "Work expands so as to fill the time available for its completion.",
    ]


def test_missing_fortunes_says_how_to_install(tmp_path):
    with pytest.raises(PromptError, match="apt-get install fortunes"):
        fortune_prompts(PromptConfig(fortunes_dir=tmp_path / "absent"))


@pytest.mark.skipif(
    not PromptConfig().fortunes_dir.is_dir(), reason="Debian's fortunes package not installed"
)
def test_real_fortunes_split():
    everything = fortune_prompts()
    assert len(everything) > 10_000
    bench, train = load_prompts("fortunes", split="bench"), load_prompts("fortunes", split="train")
    assert not set(bench) & set(train) and len(bench) + len(train) == len(everything)


def test_prompt_files_and_chat_template(tmp_path):
    from genrec_spec.models.llm.smollm2 import load_smollm2_tokenizer

    tokenizer = load_smollm2_tokenizer()
    lines = tmp_path / "prompts.txt"
    lines.write_text("first prompt\n\nsecond prompt\nthird prompt\n")
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text("\n".join(json.dumps({"prompt": p}) for p in ["a b", "c d"]))
    assert sorted(load_prompts(lines, split="all")) == [
        "first prompt",
        "second prompt",
        "third prompt",
    ]
    assert sorted(load_prompts(jsonl, split="all", tokenizer=tokenizer)) == ["a b", "c d"]
    chat = load_prompts(jsonl, split="all", seed=3, tokenizer=tokenizer, chat=True)
    assert all(p.startswith("<|im_start|>") and p.endswith("<|im_start|>assistant\n") for p in chat)
    assert {p.split("<|im_start|>user\n")[1][:3] for p in chat} == {"a b", "c d"}
    if PromptConfig().fortunes_dir.is_dir():  # fortunes are chat prompts with an instruction
        (fortune,) = load_prompts("fortunes", n=1, tokenizer=tokenizer)
        assert PromptConfig().chat_instruction in fortune and "<|im_start|>user" in fortune
    with pytest.raises(PromptError, match="does not exist"):
        load_prompts(tmp_path / "absent.txt")
    with pytest.raises(PromptError, match="is a folder"):
        load_prompts(tmp_path)
    (tmp_path / "empty.txt").write_text("\n")
    with pytest.raises(PromptError, match="no prompt"):
        load_prompts(tmp_path / "empty.txt")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    with pytest.raises(PromptError, match="is not UTF-8 text"):
        load_prompts(tmp_path / "latin1.txt")
    for bad in ('{"prompt": 1}', '{"text": "a"}', '{"prompt": "a"', '["a"]'):
        (tmp_path / "bad.jsonl").write_text('{"prompt": "fine"}\n\n' + bad + "\n")
        with pytest.raises(PromptError, match="line 3, is not an object with a string .prompt"):
            load_prompts(tmp_path / "bad.jsonl")


def test_stdlib_prompts_are_whole_function_heads():
    """Every pystdlib prompt is a def line (or lines) and its docstring that parse on their own
    as a function, so the target continues a function body as it does a HumanEval prompt."""
    import ast

    everything = stdlib_prompts()
    assert len(everything) > 2_000 and len(set(everything)) == len(everything)
    for text in everything:
        (function,) = ast.parse(text).body
        assert isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef)
        assert len(function.body) == 1 and ast.get_docstring(function)
    assert any(text.startswith("def dedent(text):\n") for text in everything)  # textwrap's
    bench, train = load_prompts("pystdlib", split="bench"), load_prompts("pystdlib", split="train")
    assert not set(bench) & set(train) and len(bench) + len(train) == len(everything)


def test_corpus_entries_with_their_own_count():
    assert source_and_count("pystdlib:800", 64) == ("pystdlib", 800)
    assert source_and_count("humaneval", 64) == ("humaneval", 64)
    assert source_and_count("prompts:v2.txt", 5) == ("prompts:v2.txt", 5)  # a path, not a count
