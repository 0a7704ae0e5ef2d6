"""Model-free drafts from the text itself (deterministic: draft_probs None).

- ``PromptLookup``: prompt lookup decoding. Find the most recent earlier occurrence of the
  context's last n tokens (n from max_ngram down to min_ngram) in prompt + output and propose
  the k tokens that followed it, as a chain. Vectorised over the batch.
- ``TrieProposer``: the multi-branch form (as Ant Group's Lookahead / PIA framework): every
  n-gram of the prompt and of the generated text is counted in a per-row trie, inserted on the
  fly and pruned to a memory budget; the continuations of the context's suffix are proposed as
  one tree, most frequent branches first, up to a node budget.
"""

from __future__ import annotations

import heapq

import torch

from genrec_spec.core.prompt_lookup import continuation_starts
from genrec_spec.core.tree import chain, from_lists
from genrec_spec.core.types import Acceptance, DecodeInputError, DecodeState, DraftTree


class PromptLookup:
    draft_cost = 0.0
    hidden_layers: tuple[int, ...] = ()

    def __init__(self, k: int = 4, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram or k < 1:
            raise DecodeInputError(
                f"k={k}, min_ngram={min_ngram}, max_ngram={max_ngram}",
                "use k >= 1 and 1 <= min_ngram <= max_ngram",
            )
        self.k, self.max_ngram, self.min_ngram = k, max_ngram, min_ngram

    def begin(self, state: DecodeState) -> None:
        pass

    def observe(self, state: DecodeState, acceptance: Acceptance) -> None:
        pass

    def propose(self, state: DecodeState, budget: int) -> DraftTree:
        tokens, lengths = state.tokens, state.lengths  # [B, T], [B]
        width = tokens.shape[1]
        follow = continuation_starts(tokens, lengths, self.max_ngram, self.min_ngram)  # [B]
        positions = follow[:, None] + torch.arange(budget, device=tokens.device)  # [B, K]
        valid = (follow[:, None] >= 0) & (positions < lengths[:, None])
        # Trim to the longest match (one host read): unmatched positions would cost target
        # compute for nothing.
        k = int(valid.sum(1).max())
        drafts = tokens.gather(1, positions[:, :k].clamp(0, width - 1))
        return chain(state.roots, drafts, valid=valid[:, :k])


class _Node:
    __slots__ = ("children", "count")

    def __init__(self) -> None:
        self.children: dict[int, _Node] = {}
        self.count = 0


class NgramTrie:
    """Occurrence counts of every n-gram (n <= max_len) of a growing text, as a trie: the node
    at path (t1, ..., tn) counts the occurrences of t1..tn. When it grows past max_nodes, all
    counts are halved and nodes reaching 0 are dropped (a frequency-decaying memory budget)."""

    def __init__(self, max_len: int, max_nodes: int) -> None:
        self.root = _Node()
        self.max_len = max_len
        self.max_nodes = max_nodes
        self.size = 0
        self.text: list[int] = []

    def extend(self, tokens: list[int]) -> None:
        """Append tokens to the text and count the n-grams ending at each new token."""
        for token in tokens:
            self.text.append(token)
            end = len(self.text)
            for start in range(max(0, end - self.max_len), end):
                node = self.root
                for t in self.text[start : end - 1]:  # counted when it ended; pruning may
                    node = self._child(node, t)  # have dropped it: then it restarts at 0
                self._child(node, token).count += 1
        if self.size > self.max_nodes:
            self._halve(self.root)

    def _child(self, node: _Node, token: int) -> _Node:
        child = node.children.get(token)
        if child is None:
            child = node.children[token] = _Node()
            self.size += 1
        return child

    def _halve(self, node: _Node) -> None:
        for token, child in list(node.children.items()):
            child.count //= 2
            if child.count == 0:
                self.size -= self._count_nodes(child)
                del node.children[token]
            else:
                self._halve(child)

    def _count_nodes(self, node: _Node) -> int:
        return 1 + sum(self._count_nodes(child) for child in node.children.values())

    def branches(self, prefix_len: int, depth: int, max_nodes: int) -> tuple[list[int], list[int]]:
        """Continuations of the text's longest suffix (<= prefix_len tokens) that the trie
        knows, as tree nodes below a root (tokens, parents; the root itself excluded, parents
        relative to the root = -1), most frequent first, at most max_nodes nodes and depth."""
        for n in range(min(prefix_len, len(self.text)), 0, -1):
            node = self.root
            for t in self.text[-n:]:
                node = node.children.get(t)
                if node is None:
                    break
            if node is not None and node.children:
                return self._best_first(node, min(depth, self.max_len - n), max_nodes)
        return [], []

    @staticmethod
    def _best_first(start: _Node, depth: int, max_nodes: int) -> tuple[list[int], list[int]]:
        tokens: list[int] = []
        parents: list[int] = []
        heap = [(-c.count, t, -1, 1, c) for t, c in start.children.items()]
        heapq.heapify(heap)
        while heap and len(tokens) < max_nodes:
            _, token, parent, level, node = heapq.heappop(heap)
            tokens.append(token)
            parents.append(parent)
            if level < depth:
                index = len(tokens) - 1
                for t, c in node.children.items():
                    heapq.heappush(heap, (-c.count, t, index, level + 1, c))
        return tokens, parents


class TrieProposer:
    """Multi-branch n-gram drafts from a per-row trie of the prompt and the generated text.
    Host-side (Python dicts): one read of the new tokens per step."""

    draft_cost = 0.0
    hidden_layers: tuple[int, ...] = ()

    def __init__(
        self, k: int = 4, prefix_len: int = 2, max_nodes: int = 16, trie_nodes: int = 1 << 16
    ) -> None:
        if k < 1 or prefix_len < 1 or max_nodes < 1:
            raise DecodeInputError(
                f"k={k}, prefix_len={prefix_len}, max_nodes={max_nodes}", "use positive values"
            )
        self.k, self.prefix_len, self.max_nodes, self.trie_nodes = (
            k,
            prefix_len,
            max_nodes,
            trie_nodes,
        )

    def begin(self, state: DecodeState) -> None:
        self.tries = []
        for row, length in zip(state.tokens.tolist(), state.lengths.tolist(), strict=True):
            trie = NgramTrie(self.prefix_len + self.k, self.trie_nodes)
            trie.extend(row[:length])
            self.tries.append(trie)

    def observe(self, state: DecodeState, acceptance: Acceptance) -> None:
        for trie, row, count in zip(
            self.tries, acceptance.tokens.tolist(), state.counts.tolist(), strict=True
        ):
            trie.extend(row[:count])

    def propose(self, state: DecodeState, budget: int) -> DraftTree:
        tokens, parents = [], []
        for trie in self.tries:
            branch_tokens, branch_parents = trie.branches(self.prefix_len, budget, self.max_nodes)
            tokens.append([trie.text[-1]] + branch_tokens)
            parents.append([-1] + [p + 1 for p in branch_parents])
        return from_lists(tokens, parents, device=state.tokens.device)
