"""Dynamic micro-batching: concurrent requests share decoder calls and each still gets exactly
the answer of a direct single `recommend` call; the batcher groups by key and respects its
limits."""

import asyncio
import time

import httpx
import pytest
import torch

from genrec_spec.recsys.decoders.registry import DECODERS
from genrec_spec.recsys.recommend import recommend
from genrec_spec.serve import batcher as batcher_module
from genrec_spec.serve.batcher import MicroBatcher, QueueFullError


@pytest.mark.parametrize("decoder", sorted(DECODERS))
def test_concurrent_answers_equal_single_calls(start_service, retriever, decoder):
    users = [f"u{i}" for i in range(10)]
    bodies = [{"user_id": u, "k": 6, "decoder": decoder} for u in users]
    bodies += [{"user_id": u, "k": 6, "decoder": decoder, "exclude_seen": True} for u in users]
    bodies += [{"history": ["i5", "i6", "i7"], "k": 6, "decoder": decoder}, {"history": []}]
    with start_service(max_wait_ms=400, max_batch=32) as url:

        async def burst():
            async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                return await asyncio.gather(*(client.post("/v1/recommend", json=b) for b in bodies))

        answers = [r.json() for r in asyncio.run(burst())]
    assert max(a["batch_size"] for a in answers) > 1  # requests did share decoder calls
    model, data = retriever.model, retriever.data
    for body, answer in zip(bodies, answers, strict=True):
        if "user_id" in body:
            history = retriever.user_history(body["user_id"])
        else:
            history = retriever.item_indices(body["history"])
        exclude = [sorted(set(history))] if body.get("exclude_seen") else None
        alone = recommend(
            model,
            [history],
            k=body.get("k", 10),
            decoder=body.get("decoder", "beam"),
            exclude=exclude,
        )
        real = alone.items[0] >= 0
        assert answer["items"] == [data.item_ids[i] for i in alone.items[0][real].tolist()]
        torch.testing.assert_close(
            torch.tensor(answer["scores"]), alone.scores[0][real], rtol=0, atol=1e-4
        )


def _run_batcher(jobs, **limits):
    """Submit (key, payload) jobs at once; returns (results, the batches run)."""
    batches = []

    def run(key, payloads):
        batches.append((key, list(payloads)))
        return [(key, p * 10) for p in payloads]

    async def main():
        batcher = MicroBatcher(run, **limits)
        batcher.start()
        try:
            return await asyncio.gather(
                *(batcher.submit(key, p, timeout_s=5) for key, p in jobs), return_exceptions=True
            )
        finally:
            await batcher.stop()

    return asyncio.run(main()), batches


def test_batcher_groups_by_key_and_caps_batches():
    jobs = [("a", 1), ("b", 2), ("a", 3), ("a", 4), ("b", 5), ("a", 6), ("a", 7)]
    results, batches = _run_batcher(jobs, max_batch=3, max_wait_s=0.05, max_queue=100)
    assert results == [(key, p * 10) for key, p in jobs]
    # The oldest waiting request goes first: b's 2 arrived before a's 6.
    assert batches == [("a", [1, 3, 4]), ("b", [2, 5]), ("a", [6, 7])]


def test_batcher_refuses_beyond_the_queue_and_reports_failures():
    results, batches = _run_batcher(
        [("a", i) for i in range(5)], max_batch=8, max_wait_s=0.05, max_queue=3
    )
    assert results[:3] == [("a", 0), ("a", 10), ("a", 20)]
    assert all(isinstance(r, QueueFullError) for r in results[3:])
    assert batches == [("a", [0, 1, 2])]

    async def failing():
        batcher = MicroBatcher(
            lambda key, payloads: 1 / 0, max_batch=4, max_wait_s=0.01, max_queue=4
        )
        batcher.start()
        try:
            return await asyncio.gather(
                *(batcher.submit("a", i, timeout_s=5) for i in range(2)), return_exceptions=True
            )
        finally:
            await batcher.stop()

    assert all(isinstance(r, ZeroDivisionError) for r in asyncio.run(failing()))


def test_batcher_waits_only_for_the_company_it_expects():
    """A lone client's request ran after the whole batch window (5 ms of a 5-10 ms answer): a
    group now runs once it holds the requests its key's last batch answered (and those then
    waiting), and waits out the window only for company that does not come (a key's first batch
    waits for it as before)."""
    batches = []

    def run(key, payloads):
        batches.append(list(payloads))
        return payloads

    async def timed(batcher, payloads):  # submitted together: answers, seconds they took
        start = time.monotonic()
        answers = await asyncio.gather(*(batcher.submit("a", p, timeout_s=5) for p in payloads))
        return answers, time.monotonic() - start

    async def main():
        batcher = MicroBatcher(run, max_batch=8, max_wait_s=0.5, max_queue=100)
        batcher.start()
        try:
            return [await timed(batcher, payloads) for payloads in ([1, 2], [3, 4], [5], [6])]
        finally:
            await batcher.stop()

    (first, window), (pair, pair_s), (five, five_s), (six, six_s) = asyncio.run(main())
    assert batches == [[1, 2], [3, 4], [5], [6]] and first + pair + five + six == [1, 2, 3, 4, 5, 6]
    assert window >= 0.45  # a key's first batch: the whole window
    assert pair_s < 0.25  # as many as the last batch: no wait
    assert five_s >= 0.45  # one of the two expected: the window, then alone
    assert six_s < 0.25  # the last batch was one request


def test_batcher_remembers_the_company_of_a_bounded_number_of_keys(monkeypatch):
    """Requests choose their keys (decoder, k, options): the expected company of each key run
    is kept for the most recent COMPANY_KEYS keys only, not for every combination ever sent."""
    monkeypatch.setattr(batcher_module, "COMPANY_KEYS", 2)

    async def main():
        batcher = MicroBatcher(lambda key, payloads: payloads, max_batch=1, max_wait_s=0.01,
                               max_queue=10)  # fmt: skip
        batcher.start()
        try:
            for key in ("a", "b", "c", "b"):
                await batcher.submit(key, 0, timeout_s=5)
            return list(batcher._company)
        finally:
            await batcher.stop()

    assert asyncio.run(main()) == ["c", "b"]
