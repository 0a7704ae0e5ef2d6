"""Cross-tokenizer drafting (genrec_spec.llm.proposers.cross_tokenizer): the text alignment on the
real Gemma-3 and SmolLM2 tokenizers, exactness on tiny models with two toy tokenizers (greedy
equality, and the exact distribution under sampling), greedy equality on the real pair (Gemma-3
target, SmolLM2 draft) against plain decoding and Hugging Face's universal assisted
generation, and clear errors."""

import pytest
import torch

from genrec_spec import ControllerConfig, DecodeInputError, SamplingParams, generate
from genrec_spec.core.greedy_check import compare_greedy
from genrec_spec.llm.proposers import CrossTokenizerProposer, TokenBridge
from genrec_spec.llm.proposers.cross_tokenizer import common_prefix


class PieceTokenizer:
    """A toy tokenizer: greedy longest match over a list of pieces, plus special tokens; the
    part of a transformers tokenizer the bridge uses."""

    def __init__(self, pieces: list[str], special: tuple[str, ...] = ()) -> None:
        self.pieces = pieces + list(special)
        self.regular = len(pieces)
        self.all_special_ids = list(range(len(pieces), len(self.pieces)))

    def __len__(self) -> int:
        return len(self.pieces)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids, i = [], 0
        while i < len(text):
            fits = [j for j in range(self.regular) if text.startswith(self.pieces[j], i)]
            best = max(fits, key=lambda j: len(self.pieces[j]))
            ids.append(best)
            i += len(self.pieces[best])
        return ids

    def decode(self, ids, skip_special_tokens=False, clean_up_tokenization_spaces=False) -> str:
        special = set(self.all_special_ids) if skip_special_tokens else set()
        return "".join(self.pieces[i] for i in ids if i not in special)


# Target vocabulary of 8 (the exact-distribution checks' size), draft vocabulary of 11 with an
# end-of-text token: the two split the same strings differently.
TARGET_PIECES = ["a", "b", "c", "d", "ab", "cd", "ba", "dc"]
DRAFT_PIECES = ["a", "b", "c", "d", "bc", "da", "aa", "cc", "bb", "ad"]


def toy_bridge() -> tuple[PieceTokenizer, PieceTokenizer]:
    return PieceTokenizer(TARGET_PIECES), PieceTokenizer(DRAFT_PIECES, special=("<eos>",))


@pytest.fixture(scope="module")
def real_tokenizers():
    from genrec_spec.models.llm.gemma3 import load_gemma3_tokenizer
    from genrec_spec.models.llm.smollm2 import load_smollm2_tokenizer

    return load_gemma3_tokenizer(), load_smollm2_tokenizer()


# Unicode (multi-byte characters SmolLM2 splits across byte tokens, a no-break space Gemma-3
# spells as two byte-fallback tokens), whitespace runs, tabs, CRLF, code indentation.
TRICKY = [
    "naïve café, 日本語 and 🙂: ok",
    "a\u00a0b  \r\n c\t\td",
    'def f(x):\n\tif x:\n        return  x  \n\n\n    """doc"""\n',
    "    for i in range(len(lst)):\n        if lst[i] % 2 == 0:",
]


@pytest.mark.parametrize("text", TRICKY)
def test_alignment_on_real_tokenizers(real_tokenizers, text):
    """At every target token boundary, the draft context spells exactly the committed text (or
    is None inside a UTF-8 character); the draft's continuation maps back to target tokens that
    extend the committed tokens to exactly the full text."""
    gemma, smollm2 = real_tokenizers
    bridge = TokenBridge(gemma, smollm2)
    target_ids = gemma.encode(text, add_special_tokens=True)  # with <bos>
    assert gemma.decode(target_ids, skip_special_tokens=True) == text
    incomplete = 0
    for i in range(1, len(target_ids) + 1):
        committed = gemma.decode(target_ids[:i], skip_special_tokens=True)
        context = bridge.draft_context(target_ids[:i])
        if committed.endswith("\ufffd"):  # inside a character spelled in bytes
            assert context is None
            incomplete += 1
            continue
        if not committed:
            assert context is None  # only <bos>: nothing to draft from
            continue
        assert smollm2.decode(context) == committed
        rest = text[len(committed) :]
        drafted = smollm2.encode(rest, add_special_tokens=False)
        if not drafted:
            continue
        proposal = bridge.to_target(context, drafted, drop_last=False)
        assert gemma.decode(target_ids[:i] + proposal, skip_special_tokens=True) == text
        dropped = bridge.to_target(context, drafted, drop_last=True)
        assert dropped == proposal[:-1]
    assert incomplete == (1 if "\u00a0" in text else 0)


def test_partial_token_is_rolled_back(real_tokenizers):
    """A text that ends inside a draft token ("ret" before "urn") is re-tokenized once it goes
    on: the common prefix with the old context stops before the partial token."""
    gemma, smollm2 = real_tokenizers
    bridge = TokenBridge(gemma, smollm2)
    before = bridge.draft_context(gemma.encode("def f(x):\n    ret"))
    after = bridge.draft_context(gemma.encode("def f(x):\n    return x"))
    keep = common_prefix(before, after)
    assert keep == len(before) - 1 and smollm2.decode(after[keep:]) == " return x"


def test_special_token_ends_the_draft(real_tokenizers):
    """Draft text is cut at a draft special token (SmolLM2's <|im_end|>), and then the last
    target token is final; an unfinished character at the draft's end is left out."""
    gemma, smollm2 = real_tokenizers
    bridge = TokenBridge(gemma, smollm2)
    context = smollm2.encode("x =", add_special_tokens=True)
    drafted = smollm2.encode(" 1 + 2", add_special_tokens=False) + [smollm2.eos_token_id, 10]
    assert gemma.decode(bridge.to_target(context, drafted)) == " 1 + 2"
    drafted = smollm2.encode(" ok 日本語", add_special_tokens=False)  # bytes split the kanji
    cut = next(i for i in range(len(drafted)) if smollm2.decode(drafted[:i]).endswith("\ufffd"))
    assert smollm2.decode(drafted[:cut]).startswith(" ok")
    text = smollm2.decode(drafted[:cut]).rstrip("\ufffd")
    assert gemma.decode(bridge.to_target(context, drafted[:cut], drop_last=False)) == text
    assert common_prefix([1, 2, 3], [1, 2]) == 2 and common_prefix([], [4]) == 0


def toy_pair(kit, target_vocab_scale: float = 1.5):
    target_tok, draft_tok = toy_bridge()
    target = kit.tiny_llama(len(TARGET_PIECES), seed=0, scale=target_vocab_scale)
    draft = kit.tiny_llama(len(DRAFT_PIECES) + 1, seed=3, scale=1.5)
    return target, draft, target_tok, draft_tok


PROMPTS = [[1, 2, 3, 1, 2], [5, 4], [6]]  # B = 3, uneven: "bcdbc", "cdab", "ba"


@pytest.mark.parametrize("lookahead", [0, 1])
def test_toy_greedy_equals_plain(kit, lookahead):
    target, draft, target_tok, draft_tok = toy_pair(kit)
    plain = generate(target, PROMPTS, max_new_tokens=16)
    proposer = CrossTokenizerProposer(draft, draft_tok, target_tok, k=3, lookahead=lookahead)
    out = generate(
        target,
        PROMPTS,
        proposer=proposer,
        max_new_tokens=16,
        controller=ControllerConfig(adaptive=False),
    )
    assert out.tolist() == plain.tolist()
    assert out.stats.accepted_per_position[0] > 0  # drafts were accepted: the test has teeth
    assert out.stats.row_steps < plain.stats.row_steps


def test_draft_cache_grows(kit):
    """The draft spells "ab" in two tokens where the target uses one: its cache outgrows the
    first allocation (the target's width + 16) and is doubled, without changing the output."""
    target, draft, target_tok, draft_tok = toy_pair(kit)
    prompts = [[4] * 20, [6]]  # "abab...": 20 target tokens, 40 draft tokens
    plain = generate(target, prompts, max_new_tokens=8)
    proposer = CrossTokenizerProposer(draft, draft_tok, target_tok, k=3)
    fixed = ControllerConfig(adaptive=False)
    out = generate(target, prompts, proposer=proposer, max_new_tokens=8, controller=fixed)
    assert out.tolist() == plain.tolist()
    assert proposer.cache.max_len > 20 + 8 + 16


def test_toy_sampling_is_exact(kit):
    """Under sampling the proposal is a one-hot draft and recursive rejection sampling keeps the
    output distributed exactly as the target's (first 3 tokens, 6,000 rows per prompt)."""
    target_tok, draft_tok = toy_bridge()
    target = kit.exact_target()
    draft = kit.tiny_llama(len(DRAFT_PIECES) + 1, seed=3, scale=1.5)
    proposer = CrossTokenizerProposer(draft, draft_tok, target_tok, k=2)
    kit.assert_exact(target, proposer, SamplingParams(temperature=1.0))


def test_bad_input(kit):
    target, draft, target_tok, draft_tok = toy_pair(kit)
    with pytest.raises(DecodeInputError, match="genrec_spec Llama"):
        CrossTokenizerProposer(kit.ChainLM(draft), draft_tok, target_tok)
    with pytest.raises(DecodeInputError, match="k >= 1"):
        CrossTokenizerProposer(draft, draft_tok, target_tok, k=0)
    wide = PieceTokenizer(TARGET_PIECES + ["abc"])  # 9 tokens for an 8-token target
    with pytest.raises(DecodeInputError, match="target model's own tokenizer"):
        generate(target, PROMPTS, proposer=CrossTokenizerProposer(draft, draft_tok, wide))


def test_cli_refuses_mismatched_methods():
    from genrec_spec.llm.methods import check_method

    check_method("gemma3", "cross")
    with pytest.raises(DecodeInputError, match="pick one of none, ngram, trie, lookahead, cross"):
        check_method("gemma3", "eagle")
    with pytest.raises(DecodeInputError, match="cross drafts for --model gemma3"):
        check_method("smollm2", "cross")


@pytest.mark.slow
def test_gemma3_target_smollm2_draft_greedy(real_tokenizers):
    """The real pair at batch 2 (uneven prompts): exactly plain greedy decoding's tokens, with
    drafts accepted; and Hugging Face's universal assisted generation (the benchmark's hf-uag
    options) gives the same text at batch 1 (slow: it converts Gemma-3 once)."""
    from genrec_spec.bench.llm_config import BenchLLMConfig
    from genrec_spec.bench.llm_runners import hf_assistance
    from genrec_spec.llm.methods import cross_tokenizer_proposer
    from genrec_spec.models.llm.gemma3 import load_gemma3

    model, gemma = load_gemma3()
    prompts = [
        "def fibonacci(n):\n    if n <= 1:\n        return n\n    return",
        "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return",
    ]
    ids = [gemma.encode(p) for p in prompts]
    assert len(ids[0]) != len(ids[1])
    plain = generate(model, ids, max_new_tokens=16, eos_token_id=gemma.eos_token_id)
    proposer = cross_tokenizer_proposer(model, gemma, k=4)
    out = generate(
        model,
        ids,
        proposer=proposer,
        max_new_tokens=16,
        eos_token_id=gemma.eos_token_id,
        controller=ControllerConfig(adaptive=False),
    )
    verdicts = compare_greedy(model, ids, plain.tolist(), out.tolist())
    assert all(v == "yes" or v.startswith("tie@") for v in verdicts), verdicts
    assert out.stats.accepted_per_position[0] > 0
    assert out.stats.row_steps < plain.stats.row_steps

    options = hf_assistance("hf-uag", model, BenchLLMConfig(model="gemma3"), gemma)
    with torch.inference_mode():
        hf = model.generate(torch.tensor(ids[:1]), max_new_tokens=16, do_sample=False, **options)
    assert hf[0, len(ids[0]) :].tolist() == plain.tolist()[0]
