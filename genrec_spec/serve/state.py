"""What the service's routes share: `ServiceState` holds the settings, the loaded recommender,
the LLM (loaded in the background) and its status, one micro-batcher per kind of model call and
the metrics. One per app, kept at ``app.state.service``."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Hashable

from genrec_spec.llm.title_recommender import TitleRecommender, folder_titles
from genrec_spec.serve.batcher import MicroBatcher, QueueFullError
from genrec_spec.serve.config import ServeConfig
from genrec_spec.serve.errors import ServiceError
from genrec_spec.serve.generation import GenerateQuery, TextGenerator
from genrec_spec.serve.metrics import ServiceMetrics
from genrec_spec.serve.retrieval import BatchKey, Query, Retriever
from genrec_spec.serve.titles import TitleKey, TitleRetriever

log = logging.getLogger("genrec_spec.serve")


class ServiceState:
    """The recommender is loaded before the service starts; `llm` (e.g. "smollm2") loads in the
    background after start-up (`llm_status` says how far it got)."""

    def __init__(self, config: ServeConfig, retriever: Retriever, llm: str | None) -> None:
        self.config, self.retriever, self.llm_name = config, retriever, llm
        self.metrics = ServiceMetrics()
        self.llm: TextGenerator | None = None
        self.titles: TitleRetriever | None = None  # the llm decoder, when the data has titles
        self.llm_status = "loading" if llm else "off"
        self.batchers: dict[str, MicroBatcher] = {}  # "recommend", "generate"
        self._loading: asyncio.Task | None = None

    # --- model calls (run in the batchers' worker thread) ---

    def run_recommend(self, key: BatchKey, queries: list[Query]) -> list[dict]:
        answers, stats = self.retriever.run(key, queries)
        passes = stats.get("target_passes", 0)
        levels = self.retriever.model.num_levels
        self.metrics.model_call("recommend", key.decoder, passes, levels, passes)
        for how in ("exact", "extended", "missed"):
            if f"history_{how}" in stats:
                self.metrics.history_rows.labels(how).inc(stats[f"history_{how}"])
        return answers

    def run_titles(self, key: TitleKey, queries: list[Query]) -> list[dict]:
        answers, stats = self.titles.run(key, queries)
        self.metrics.model_call(
            "recommend",
            "llm",
            stats["target_forwards"],
            stats["generated_tokens"],
            stats["row_steps"],
        )
        return answers

    def run_generate(self, key: Hashable, queries: list[GenerateQuery]) -> list[dict]:
        answers = [self.llm.run(query) for query in queries]
        for answer in answers:
            stats = answer["stats"]
            self.metrics.model_call(
                "generate",
                answer["method"] + (" beam" if "beams" in answer else ""),
                stats["target_forwards"],
                stats["generated_tokens"],
                stats["row_steps"],
            )
        return answers

    # --- life cycle ---

    async def load_llm(self) -> None:
        try:
            self.llm = await asyncio.to_thread(TextGenerator.load, self.llm_name)
            titles = await asyncio.to_thread(folder_titles, self.retriever.data.path)
            if titles is not None:
                recommender = await asyncio.to_thread(
                    TitleRecommender, self.llm.model, self.llm.tokenizer, titles
                )
                self.titles = TitleRetriever(recommender, self.retriever)
            self.llm_status = "ready"
        except Exception as exc:  # reported by /readyz and /v1/generate; the rest keeps serving
            log.exception("loading the LLM %s failed", self.llm_name)
            self.llm_status = f"failed: {type(exc).__name__}: {exc}"

    def _batcher(self, run: Callable, kind: str, max_batch: int, max_wait_s: float):
        batcher = MicroBatcher(
            run,
            max_batch=max_batch,
            max_wait_s=max_wait_s,
            max_queue=self.config.max_queue,
            on_batch=self.metrics.batch_size.labels(kind).observe,
        )
        batcher.start()
        return batcher

    def start(self) -> None:
        """Start the batchers and the LLM's loading (inside the event loop)."""
        wait_s = self.config.max_wait_ms / 1e3
        self.batchers["recommend"] = self._batcher(
            self.run_recommend, "recommend", self.config.max_batch, wait_s
        )
        self.batchers["titles"] = self._batcher(
            self.run_titles, "titles", self.config.max_batch, wait_s
        )
        # One generation per model call: every request has its own seed and method.
        self.batchers["generate"] = self._batcher(self.run_generate, "generate", 1, 0.0)
        if self.llm_name:
            self._loading = asyncio.create_task(self.load_llm())

    async def stop(self) -> None:
        if self._loading is not None:
            self._loading.cancel()
        for batcher in self.batchers.values():
            await batcher.stop()

    # --- requests ---

    async def submit(self, name: str, key: Hashable, payload):
        """The answer of batcher `name` to `payload`; overload, timeout and a request the model
        refuses are `ServiceError`s."""
        config = self.config
        try:
            return await self.batchers[name].submit(key, payload, config.timeout_s)
        except QueueFullError as exc:
            raise ServiceError(
                503,
                "overloaded",
                f"the service is overloaded ({exc.problem})",
                f"retry after {config.retry_after_s} s",
                {"Retry-After": str(config.retry_after_s)},
            ) from None
        except TimeoutError:
            raise ServiceError(
                504,
                "timeout",
                f"no answer within the service's timeout of {config.timeout_s} s (the model is "
                "busy)",
                "retry later",
            ) from None
        except ValueError as exc:  # the model refused the request (e.g. an option value)
            raise ServiceError.bad_request(exc) from None
