"""Cross-tokenizer drafting: a draft model with another vocabulary drafts through text (as
Hugging Face's universal assisted generation does), e.g. SmolLM2-135M (49,152 tokens) drafting
for Gemma-3-270M (262,144 tokens).

Each step, per row, on the host:
1. *Align*: the target's committed tokens are decoded to text and the text re-tokenized by the
   draft's tokenizer. The draft keeps the K/V of the draft tokens it fed before; the longest
   common prefix with the new tokenization stays cached (``StaticKVCache.truncate``), the rest
   is fed in one ragged pass. Whole-text re-tokenization makes the draft see its own canonical
   tokenization: when the target's text ended inside a draft token ("ret" before "urn"), the
   next step's tokenization ("return") replaces the cached partial token. A text ending inside
   a UTF-8 character (a byte-fallback token of the target) is not drafted from until the
   character is complete.
2. *Draft*: ``budget + lookahead`` draft tokens, greedily (the aligning pass gives the first,
   one more pass each further token).
3. *Map back*: their text (cut at a draft special token such as eos) is encoded by the
   target's tokenizer; it starts exactly at the target's next token boundary, the end of the
   committed text. At most ``budget`` target tokens are proposed as a chain. The last one runs
   to the end of the draft, where more text could still merge into it (" fib" before
   "onacci"): with ``lookahead`` > 0 it is dropped, as HF does; by default (0) it is kept and
   left to verification, which rejects it when it was cut short: the extra draft pass per step
   that ``lookahead=1`` costs does not raise the accepted length.

The draft's proposal is a deterministic function of the committed text, so it is a one-hot
draft (``draft_probs=None``): greedy matching keeps decoding exactly plain greedy decoding's,
and recursive rejection sampling (accept x with the target's probability p(x), else sample
from p with x removed, renormalised) keeps sampling exactly distributed as the target's,
whatever the draft proposes. The host work (decode, encode, a common prefix per row) is small
next to a forward.

Tokenizers are used through ``encode(text, add_special_tokens=...)``, ``decode(ids,
skip_special_tokens=True, clean_up_tokenization_spaces=False)``, ``all_special_ids`` and
``len()`` (any ``transformers`` tokenizer). The target's tokenizer must encode a text alone the
way it continues a longer one (no added space prefix: Gemma-3, Llama-3, Qwen, GPT-2-style
byte-level BPE all qualify; Llama-2's SentencePiece with its dummy prefix does not).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from genrec_spec.core.types import Acceptance, DecodeInputError, DecodeState, DraftTree

INCOMPLETE = "\ufffd"  # what decoding leaves for the bytes of an unfinished UTF-8 character


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class TokenBridge:
    """Text-level conversions between a target tokenizer and a draft tokenizer (host side,
    pure functions of token lists; see the module docstring)."""

    def __init__(self, target_tokenizer: Any, draft_tokenizer: Any) -> None:
        self.target = target_tokenizer
        self.draft = draft_tokenizer
        self.draft_special = frozenset(draft_tokenizer.all_special_ids)

    @staticmethod
    def _decode(tokenizer: Any, ids: Sequence[int]) -> str:
        return tokenizer.decode(
            list(ids), skip_special_tokens=True, clean_up_tokenization_spaces=False
        )

    def draft_context(self, target_ids: Sequence[int]) -> list[int] | None:
        """The draft tokenization of the target's committed text (special tokens dropped), or
        None when there is nothing to draft from: the text ends inside a UTF-8 character or
        encodes to no draft token."""
        text = self._decode(self.target, target_ids)
        if text.endswith(INCOMPLETE):
            return None
        ids = list(self.draft.encode(text, add_special_tokens=True))
        return ids or None

    def to_target(
        self, context: Sequence[int], drafted: Sequence[int], drop_last: bool = True
    ) -> list[int]:
        """Target tokens continuing the committed text with the text of ``drafted`` (draft
        tokens after ``context``): cut at the first draft special token, decoded after the last
        context token (so decoders that strip a leading space see the boundary), encoded by the
        target's tokenizer; the last target token is dropped unless a special token ended the
        draft (then the text before it is final)."""
        ended = False
        for i, token in enumerate(drafted):
            if token in self.draft_special:
                drafted, ended = drafted[:i], True
                break
        if not drafted:
            return []
        lead = list(context[-1:])
        before = self._decode(self.draft, lead)
        text = self._decode(self.draft, lead + list(drafted))
        text = text[len(before) :] if text.startswith(before) else self._decode(self.draft, drafted)
        stripped = text.rstrip(INCOMPLETE)  # an unfinished character at the draft's end
        ids = list(self.target.encode(stripped, add_special_tokens=False))
        return ids[:-1] if drop_last and not (ended and stripped == text) else ids


class CrossTokenizerProposer:
    """Drafts with a native ``genrec_spec`` Llama (e.g. SmolLM2 from ``load_smollm2``) whose
    tokenizer differs from the target's; see the module docstring."""

    def __init__(
        self,
        draft: Any,
        draft_tokenizer: Any,
        target_tokenizer: Any,
        k: int = 4,
        draft_cost: float = 0.5,
        lookahead: int = 0,
    ) -> None:
        """draft: the draft model (``genrec_spec.models.llm.llama.Llama``) and its tokenizer;
        target_tokenizer: the target's; k: the most target tokens proposed per step;
        draft_cost: one draft forward's cost relative to a target forward (for the
        controller; about the ratio of the two models' parameter counts on a CPU);
        lookahead: draft tokens drafted past the budget, whose text only confirms where the
        last proposed target token ends (> 0 drops that token; see the module docstring)."""
        from genrec_spec.models.llm.llama import Llama

        if not isinstance(draft, Llama):
            raise DecodeInputError(
                f"the cross-tokenizer draft is a {type(draft).__name__}",
                "pass a genrec_spec Llama (e.g. genrec_spec.models.llm.smollm2.load_smollm2()[0]): "
                "the proposer rolls its KV cache back to the text both models share",
            )
        if k < 1 or lookahead < 0:
            raise DecodeInputError(f"k={k}, lookahead={lookahead}", "use k >= 1, lookahead >= 0")
        self.draft = draft.eval()
        self.bridge = TokenBridge(target_tokenizer, draft_tokenizer)
        self.target_vocab = len(target_tokenizer)
        self.k = k
        self.lookahead = lookahead
        self.draft_cost = draft_cost
        self.hidden_layers: tuple[int, ...] = ()

    def begin(self, state: DecodeState) -> None:
        if self.target_vocab > state.vocab_size:
            raise DecodeInputError(
                f"the target tokenizer given to the proposer has {self.target_vocab} tokens, "
                f"more than the target model's {state.vocab_size}",
                "pass the target model's own tokenizer as target_tokenizer",
            )
        # Room for about as many draft tokens as target tokens; _draft grows it when needed.
        size = min(state.tokens.shape[1] + 16, self._max_len())
        self.cache = self.draft.new_cache(state.batch_size, size)
        self.cached: list[list[int]] = [[] for _ in range(state.batch_size)]  # [B] fed ids

    def _max_len(self) -> int:
        return self.draft.config.max_seq_len

    def propose(self, state: DecodeState, budget: int) -> DraftTree:
        batch, device = state.batch_size, state.tokens.device
        # The one host read: lengths, finished flags and committed tokens of every row.
        host = torch.cat([state.lengths[:, None], state.finished[:, None].long(), state.tokens], 1)
        contexts = []
        for length, finished, *tokens in host.tolist():
            context = None if finished else self.bridge.draft_context(tokens[:length])
            if context is not None and len(context) + budget + self.lookahead > self._max_len():
                context = None  # past the draft's context window: no draft for this row
            contexts.append(context)
        drafted = self._draft(contexts, budget + self.lookahead)  # [B] lists of draft tokens
        proposals = [
            []
            if context is None
            else self.bridge.to_target(context, row, self.lookahead > 0)[:budget]
            for context, row in zip(contexts, drafted, strict=True)
        ]
        width = max(len(p) for p in proposals)
        tokens = state.tokens.new_zeros(batch, 1 + width)
        valid = torch.zeros(batch, 1 + width, dtype=torch.bool)
        for b, proposal in enumerate(proposals):
            tokens[b, 1 : 1 + len(proposal)] = torch.tensor(proposal, dtype=torch.long)
            valid[b, : 1 + len(proposal)] = True
        tokens[:, 0] = state.roots
        parents = torch.arange(-1, width, device=device).expand(batch, -1).contiguous()
        return DraftTree(tokens=tokens, parents=parents, valid=valid.to(device))

    def _draft(self, contexts: list[list[int] | None], n: int) -> list[list[int]]:
        """Align the draft's cache with each row's context and draft n tokens greedily per row
        (rows without a context get none): [B] lists."""
        batch, device = len(contexts), self.cache.lengths.device
        keep, feed = [], []
        for cached, context in zip(self.cached, contexts, strict=True):
            if context is None:  # leave the row's cache as it is
                keep.append(len(cached))
                feed.append([])
                continue
            # Feed at least the last context token: its logits give the first draft token.
            keep.append(min(common_prefix(cached, context), len(context) - 1))
            feed.append(context[keep[-1] :])
        if not any(feed):
            return [[] for _ in contexts]
        width = max(len(f) for f in feed)
        # The pass's pending slots follow the longest row.
        self.cache.reserve(max(keep) + width + n, self._max_len())
        self.cache.truncate(torch.tensor(keep, device=device))
        ids = torch.tensor([f + [0] * (width - len(f)) for f in feed], device=device)
        counts = torch.tensor([len(f) for f in feed], device=device)
        logits = self.draft(ids, self.cache)  # [B, W, V]; padding after each row's real tokens
        self.cache.commit(torch.arange(width, device=device).expand(batch, -1), counts)
        last = logits.gather(
            1, (counts - 1).clamp_min(0)[:, None, None].expand(-1, 1, logits.shape[2])
        )
        tokens = [last[:, 0].argmax(-1)]  # [B] each
        active = (counts > 0).long()
        for _ in range(n - 1):
            logits = self.draft(tokens[-1][:, None], self.cache)  # [B, 1, V]
            self.cache.commit(torch.zeros(batch, 1, dtype=torch.long, device=device), active)
            tokens.append(logits[:, 0].argmax(-1))
        drafted = torch.stack(tokens, dim=1).tolist()  # [B, n]
        out = []
        for b, context in enumerate(contexts):
            if context is None:
                out.append([])
                continue
            self.cached[b] = context + drafted[b][:-1]  # the last drafted token was not fed
            out.append(drafted[b])
        return out

    def observe(self, state: DecodeState, acceptance: Acceptance) -> None:
        """Nothing to do: the next ``propose`` aligns the draft with whatever was committed."""
