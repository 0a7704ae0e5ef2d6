"""Lookahead decoding (Fu et al., 2024): Jacobi iterations generate n-grams, a pool keeps them,
and pool entries that start with the current root are verified, all in one target forward.

Both branches of Lookahead are one draft tree here, so the generic loop runs it:
- the lookahead branch, a window of W columns and N - 1 levels of past Jacobi guesses. Level 0
  is a chain below the root (column c at depth c + 1); level r of column c hangs under level
  r - 1 of the same column (depth c + 1 + r). This is exactly Lookahead's attention pattern:
  each guess sees level 0 up to its column, then its own column's earlier levels;
- the verification branch: up to G pool n-grams that start with the root, merged as a trie.
Every node is a valid deterministic draft (a window path is a Jacobi guess), so acceptance may
take any of them; the verification branch is where long matches come from.

After the forward, the target's argmax at each top-level guess extends its column's diagonal
into an N-gram (level 0 .. N - 2 of the column plus the prediction), which enters the pool
keyed by its first token; the levels then shift down by one (the newest prediction becomes the
top level), as Lookahead does regardless of how many tokens were accepted.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from genrec_spec.core.tree import from_lists
from genrec_spec.core.types import Acceptance, DecodeInputError, DecodeState, DraftTree


class LookaheadProposer:
    draft_cost = 0.0
    hidden_layers: tuple[int, ...] = ()

    def __init__(
        self, window: int = 4, ngram: int = 3, verify: int = 4, pool_from_text: bool = True
    ) -> None:
        """window W, ngram N (>= 2), verify G: pool n-grams checked per step;
        pool_from_text: also pool the n-grams of the prompt and the accepted text."""
        if window < 1 or ngram < 2 or verify < 0:
            raise DecodeInputError(
                f"window={window}, ngram={ngram}, verify={verify}",
                "use window >= 1, ngram >= 2, verify >= 0",
            )
        self.window, self.ngram, self.verify = window, ngram, verify
        self.pool_from_text = pool_from_text
        self.k = window + ngram - 2  # the deepest window node

    def begin(self, state: DecodeState) -> None:
        batch, levels = state.batch_size, self.ngram - 1
        # Jacobi guesses start as random prompt tokens (as Lookahead does).
        pick = torch.rand(
            batch, levels, self.window, generator=state.generator, device=state.tokens.device
        )
        columns = (pick * state.prompt_lengths[:, None, None]).long()
        self.levels = state.tokens.gather(1, columns.flatten(1)).view(batch, levels, -1)
        self.pools: list[OrderedDict] = [OrderedDict() for _ in range(batch)]
        if self.pool_from_text:
            for pool, row, length in zip(
                self.pools, state.tokens.tolist(), state.lengths.tolist(), strict=True
            ):
                self._pool_text(pool, row[:length], 0)
        self.columns = 0

    def _pool_add(self, pool: OrderedDict, gram: tuple[int, ...]) -> None:
        """Most recent first; at most G continuations per first token."""
        entries = pool.setdefault(gram[0], OrderedDict())
        entries.pop(gram[1:], None)
        entries[gram[1:]] = None
        while len(entries) > max(self.verify, 1):
            entries.popitem(last=False)

    def _pool_text(self, pool: OrderedDict, text: list[int], since: int) -> None:
        """Pool the n-grams of text that end at or after index since."""
        for end in range(max(since, self.ngram - 1), len(text)):
            self._pool_add(pool, tuple(text[end - self.ngram + 1 : end + 1]))

    def propose(self, state: DecodeState, budget: int) -> DraftTree:
        levels = self.ngram - 1
        # Window columns whose deepest guess fits in the budget (depth c + N - 1 for column c).
        self.columns = max(0, min(self.window, budget - levels + 1))
        window_parents = [-1] * (levels * self.columns)
        for r in range(levels):
            for c in range(self.columns):
                above = (r - 1) * self.columns + c if r else c - 1
                window_parents[r * self.columns + c] = above + 1  # +1: node 0 is the root
        guesses = self.levels[:, :, : self.columns].flatten(1).tolist()
        tokens, parents = [], []
        for pool, root, window in zip(self.pools, state.roots.tolist(), guesses, strict=True):
            row_tokens, row_parents = [root] + window, [-1] + window_parents
            self._add_verification(pool.get(root, {}), budget, row_tokens, row_parents)
            tokens.append(row_tokens)
            parents.append(row_parents)
        return from_lists(tokens, parents, device=state.tokens.device)

    def _add_verification(
        self, entries: dict, budget: int, tokens: list[int], parents: list[int]
    ) -> None:
        """Append the G most recent n-grams (cut to budget) as a trie under the root."""
        children: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
        for gram in list(reversed(entries))[: self.verify]:
            node = 0
            for token in gram[:budget]:
                if (node, token) not in children:
                    children[node, token] = len(tokens)
                    tokens.append(token)
                    parents.append(node)
                node = children[node, token]

    def observe(self, state: DecodeState, acceptance: Acceptance) -> None:
        if self.pool_from_text:
            for pool, row, length, count in zip(
                self.pools,
                state.tokens.tolist(),
                state.lengths.tolist(),
                state.counts.tolist(),
                strict=True,
            ):
                self._pool_text(pool, row[:length], length - count)
        if not state.speculated or self.columns == 0:
            return
        levels, columns = self.ngram - 1, self.columns
        top = 1 + (levels - 1) * columns  # tree index of the top level's first column
        predicted = state.logits[:, top : top + columns].argmax(-1)  # [B, columns]
        grams = torch.cat([self.levels[:, :, :columns], predicted[:, None]], dim=1)  # [B, N, C]
        for pool, row_grams in zip(self.pools, grams.transpose(1, 2).tolist(), strict=True):
            for gram in row_grams:
                self._pool_add(pool, tuple(gram))
        shifted = torch.cat([self.levels[:, 1:, :columns], predicted[:, None]], dim=1)
        self.levels = torch.cat([shifted, self.levels[:, :, columns:]], dim=2)
