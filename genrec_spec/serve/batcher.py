"""Dynamic micro-batching: concurrent requests that can share one model call are run together.

Requests are grouped by a key (for recommendations: decoder, k, fetch size and options: the
things one decoder call must share). A group runs as soon as it holds the company it expects,
or `max_batch` requests, or when its first request has waited `max_wait_s`. The company a key
expects is the load at hand: the requests its last batch answered (clients that send their next
request when answered come back) and those then waiting, so a lone client's request runs at once
and 64 clients' wait for each other; a key's first group expects `max_batch`. One model call
runs at a time, in a single worker thread, so the event loop stays free to accept and answer
requests; while it runs, new requests gather into the next batches. Of the groups ready, the
oldest goes first.

Overload is refused, not queued without bound: more than `max_queue` waiting requests raise
`QueueFullError` at submit. A caller that stops waiting (its timeout) leaves its request
behind; the request is skipped if its batch has not started yet.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from genrec_spec.errors import GenrecError

# Keys whose expected company is remembered, the most recently run: requests choose their keys
# (decoder, k, options), so an unbounded table would grow with every combination sent.
COMPANY_KEYS = 4096


class QueueFullError(GenrecError):
    """More requests wait for the model than the queue holds."""


@dataclass
class _Job:
    payload: Any
    future: asyncio.Future
    arrived: float = field(default_factory=time.monotonic)


class MicroBatcher:
    """Runs `run(key, payloads) -> results` (one result per payload, in order) on batches of
    submitted payloads of the same key, in one worker thread."""

    def __init__(
        self,
        run: Callable[[Hashable, Sequence[Any]], Sequence[Any]],
        *,
        max_batch: int,
        max_wait_s: float,
        max_queue: int,
        on_batch: Callable[[int], None] = lambda size: None,  # called with each batch's size
    ) -> None:
        self._run = run
        self.max_batch, self.max_wait_s, self.max_queue = max_batch, max_wait_s, max_queue
        self._on_batch = on_batch
        self._groups: dict[Hashable, list[_Job]] = {}
        # Requests a key's next group waits for: its last batch's and those waiting when that
        # batch was answered (`_serve`)
        self._company: dict[Hashable, int] = {}
        self._waiting = 0
        self._wakeup = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")
        self._task: asyncio.Task | None = None

    @property
    def waiting(self) -> int:
        """Requests submitted and not yet handed to the model."""
        return self._waiting

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._serve())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for jobs in self._groups.values():
            for job in jobs:
                if not job.future.done():
                    job.future.set_exception(RuntimeError("the service is shutting down"))
        self._executor.shutdown(wait=True)

    async def submit(self, key: Hashable, payload: Any, timeout_s: float) -> Any:
        """The result of `payload`; QueueFullError when the queue is full, TimeoutError when no
        result came within timeout_s, or the exception the model call raised."""
        if self._waiting >= self.max_queue:
            raise QueueFullError(
                f"{self._waiting} requests are waiting for the model", "retry later"
            )
        job = _Job(payload, asyncio.get_running_loop().create_future())
        self._groups.setdefault(key, []).append(job)
        self._waiting += 1
        self._wakeup.set()
        # On timeout wait_for cancels the future, which tells _serve to skip the job.
        return await asyncio.wait_for(job.future, timeout_s)

    def _next_batch(self) -> tuple[Hashable, list[_Job]] | float | None:
        """The batch to run now, else the seconds until the first group is due (None: idle)."""
        if not self._groups:
            return None
        now = time.monotonic()
        oldest_first = sorted(self._groups, key=lambda g: self._groups[g][0].arrived)
        for key in oldest_first:
            jobs = self._groups[key]
            company = min(self._company.get(key, self.max_batch), self.max_batch)
            if len(jobs) >= company or jobs[0].arrived + self.max_wait_s <= now:
                break
        else:  # none ready: the oldest is due first
            return self._groups[oldest_first[0]][0].arrived + self.max_wait_s - now
        batch, rest = jobs[: self.max_batch], jobs[self.max_batch :]
        if rest:
            self._groups[key] = rest
        else:
            del self._groups[key]
        self._waiting -= len(batch)
        return key, [job for job in batch if not job.future.done()]

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._wakeup.clear()
            ready = self._next_batch()
            if ready is None or isinstance(ready, float):
                try:  # sleep until a new request arrives or the oldest group is due
                    await asyncio.wait_for(self._wakeup.wait(), ready)
                except TimeoutError:
                    pass
                continue
            key, jobs = ready
            if not jobs:  # all of them timed out while waiting
                continue
            self._on_batch(len(jobs))
            payloads = [job.payload for job in jobs]
            try:
                results = await loop.run_in_executor(self._executor, self._run, key, payloads)
            except Exception as exc:  # the model call failed: every request of it learns why
                for job in jobs:
                    if not job.future.done():
                        job.future.set_exception(exc)
            else:
                for job, result in zip(jobs, results, strict=True):
                    if not job.future.done():
                        job.future.set_result(result)
            # Clients that send their next request when answered come back now: the next group
            # waits for them and those already waiting (a lone client's request runs at once)
            self._company.pop(key, None)  # (re-inserted last: the most recently run)
            self._company[key] = len(jobs) + len(self._groups.get(key, ()))
            if len(self._company) > COMPANY_KEYS:
                del self._company[next(iter(self._company))]
