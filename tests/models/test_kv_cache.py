"""StaticKVCache on a tiny random Llama: ragged commits, reorder, truncate, errors."""

import pytest
import torch

from genrec_spec.models.llm.kv_cache import KVCacheError

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tied(llama_kit):
    """A tiny model with tied embeddings (the SmolLM2 layout)."""
    return llama_kit.make_tiny_llama(tie_embeddings=True)


@pytest.fixture
def check_next(llama_kit):
    def check(model, cache, seqs: list[list[int]], next_tokens: list[int]) -> None:
        """One cached step with next_tokens gives the logits of each seq + token run afresh."""
        step = model(torch.tensor(next_tokens)[:, None], cache)
        for b, (seq, token) in enumerate(zip(seqs, next_tokens, strict=True)):
            expected = llama_kit.chain_logits(model, seq + [token])[-1]
            torch.testing.assert_close(step[b, 0], expected, rtol=1e-4, atol=1e-4)

    return check


@torch.no_grad()
def test_chain_drafts_commit_a_different_count_per_row(llama_kit, tied, check_next):
    """Three rounds of 3-token chain drafts, each row keeping its own prefix (0..3 tokens)."""
    cache, _ = llama_kit.prefill(tied, llama_kit.PROMPTS, max_len=32)
    seqs = [list(p) for p in llama_kit.PROMPTS]
    gen = torch.Generator().manual_seed(3)
    for keep in ([0, 3, 1], [2, 0, 3], [3, 1, 0]):
        draft = torch.randint(0, llama_kit.TINY.vocab_size, (3, 3), generator=gen)
        tied(draft, cache)
        cache.commit(torch.arange(3).expand(3, 3), torch.tensor(keep))
        for b, k in enumerate(keep):
            seqs[b] += draft[b, :k].tolist()
    assert cache.lengths.tolist() == [len(s) for s in seqs]
    check_next(tied, cache, seqs, [1, 2, 3])


@torch.no_grad()
def test_reorder_selects_and_duplicates_rows(llama_kit, tied, check_next):
    cache, _ = llama_kit.prefill(tied, llama_kit.PROMPTS, max_len=16)
    cache.reorder(torch.tensor([2, 0, 2, 1]))
    assert cache.batch_size == 4
    check_next(tied, cache, [llama_kit.PROMPTS[i] for i in (2, 0, 2, 1)], [5, 6, 7, 8])


@torch.no_grad()
def test_reorder_between_forward_and_commit_moves_pending(llama_kit, tied, check_next):
    """Beam search order: score, pick rows, then commit the picked rows' pending tokens."""
    cache, _ = llama_kit.prefill(tied, llama_kit.PROMPTS, max_len=16)
    tied(torch.tensor([[10], [11], [12]]), cache)
    cache.reorder(torch.tensor([1, 1]))
    cache.commit(torch.zeros(2, 1, dtype=torch.int64), torch.ones(2, dtype=torch.int64))
    check_next(tied, cache, [llama_kit.PROMPTS[1] + [11]] * 2, [0, 1])


@torch.no_grad()
def test_truncate_rolls_back(llama_kit, tied, check_next):
    cache, _ = llama_kit.prefill(tied, llama_kit.PROMPTS, max_len=16)
    cache.truncate(torch.tensor([2, 3, 0]))
    check_next(tied, cache, [llama_kit.PROMPTS[0][:2], llama_kit.PROMPTS[1][:3], []], [4, 5, 6])


@torch.no_grad()
def test_overflow_names_sizes_and_fix(llama_kit, tied):
    with pytest.raises(KVCacheError, match=r"0 committed tokens and this pass adds 9.*max_len 8"):
        llama_kit.prefill(tied, [[1] * 9, [2] * 3], max_len=8)
    cache, _ = llama_kit.prefill(tied, [[1] * 5, [2] * 3], max_len=8)
    tied(torch.ones(2, 3, dtype=torch.int64), cache)  # fits exactly: 5 + 3 == 8
    cache.commit(torch.arange(3).expand(2, 3), torch.tensor([3, 0]))
    with pytest.raises(KVCacheError, match="8 committed tokens.*larger max_len"):
        tied(torch.ones(2, 1, dtype=torch.int64), cache)
    cache.truncate(torch.tensor([7, 3]))
    tied(torch.ones(2, 1, dtype=torch.int64), cache)  # room again after the roll-back
    # A cache as long as the RoPE tables: the cache error comes first, not an index error.
    full = llama_kit.TINY.max_seq_len
    cache, _ = llama_kit.prefill(tied, [[1] * (full - 2), [2]], max_len=full)
    with pytest.raises(KVCacheError, match=f"{full - 2} committed tokens and this pass adds 3"):
        tied(torch.ones(2, 3, dtype=torch.int64), cache)


@torch.no_grad()
def test_misuse_raises(llama_kit, tied):
    cache, _ = llama_kit.prefill(tied, llama_kit.PROMPTS, max_len=16)
    one = torch.ones(3, dtype=torch.int64)
    with pytest.raises(KVCacheError, match="no pending entries"):
        cache.commit(torch.zeros(3, 1, dtype=torch.int64), one)
    tied(torch.ones(3, 2, dtype=torch.int64), cache)
    with pytest.raises(KVCacheError, match="node_idx has shape"):
        cache.commit(torch.zeros(3, 3, dtype=torch.int64), one)
    with pytest.raises(KVCacheError, match="n has shape"):
        cache.commit(torch.zeros(3, 1, dtype=torch.int64), one[:2])
    with pytest.raises(KVCacheError, match="only rolls back"):
        cache.truncate(cache.lengths + 1)
    with pytest.raises(KVCacheError, match="non-empty 1-D"):
        cache.reorder(torch.zeros(0, dtype=torch.int64))
    cache.truncate(cache.lengths)
    with pytest.raises(KVCacheError, match="no pending entries"):  # truncate drops them
        cache.commit(torch.zeros(3, 1, dtype=torch.int64), one)
    with pytest.raises(KVCacheError, match="positive sizes"):
        tied.new_cache(0, 8)


@torch.no_grad()
def test_pending_entries_sit_after_the_longest_row(llama_kit, tied):
    """A pass writes its K/V at [max(lengths), max(lengths) + N) of every row and leaves the
    committed entries alone; commit moves a path from there to each row's own end."""
    cache, _ = llama_kit.prefill(tied, llama_kit.PROMPTS, max_len=16)
    committed = cache.k.clone()
    longest = max(map(len, llama_kit.PROMPTS))
    tied(torch.tensor([[10, 11], [12, 13], [14, 15]]), cache)
    assert cache.pending == (longest, 2)
    for b, prompt in enumerate(llama_kit.PROMPTS):
        assert torch.equal(cache.k[:, b, :, : len(prompt)], committed[:, b, :, : len(prompt)])
    pending = cache.k[:, :, :, longest : longest + 2].clone()
    cache.commit(torch.tensor([[0, 1], [1, 0], [0, 0]]), torch.tensor([2, 1, 0]))
    for b, (prompt, nodes) in enumerate(zip(llama_kit.PROMPTS, [[0, 1], [1], []], strict=True)):
        end = len(prompt) + len(nodes)
        assert torch.equal(cache.k[:, b, :, len(prompt) : end], pending[:, b, :, nodes])


@torch.no_grad()
def test_lengths_set_directly_after_copying_into_a_bigger_cache(llama_kit, tied, check_next):
    """Growing a cache (copy K/V, set lengths) keeps the bound on the longest row true, so the
    next pass's pending entries cannot land on committed ones."""
    small, _ = llama_kit.prefill(tied, llama_kit.PROMPTS, max_len=10)
    big = tied.new_cache(3, 20)
    big.k[:, :, :, :10], big.v[:, :, :, :10] = small.k, small.v
    big.lengths = small.lengths
    check_next(tied, big, llama_kit.PROMPTS, [1, 2, 3])
