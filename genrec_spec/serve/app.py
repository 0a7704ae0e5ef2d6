"""The FastAPI app of the online retrieval service: `create_app(config, retriever, llm)`.

Endpoints (request and response bodies in `serve.schemas`; the schema is at /openapi.json):

- ``POST /v1/recommend``: top-k raw item ids for a known ``user_id`` or a ``history`` of raw
  item ids, by any decoder; concurrent requests share decoder calls (`serve.batcher`);
- ``POST /v1/generate``: LLM text with the core's methods, when the service was started with an
  LLM (else 404; 503 while it loads);
- ``GET /v1/users``: user ids of the data (what ``genrec-spec loadtest`` draws users from);
- ``GET /healthz`` (the process answers), ``GET /readyz`` (every model loaded; 503 before),
  ``GET /metrics`` (Prometheus text, `serve.metrics`).

Refusals are JSON ``{"kind": ..., "detail": ...}`` with a 4xx/5xx status and never a 500 for bad
input: 400 bad_request (unknown user, item, option; k over the limit), 422 invalid_request
(malformed JSON, wrong types, unknown fields, unknown decoder), 401 unauthorized (the
``X-API-Key`` header is missing or wrong when the service has a key; /v1/* only, health and
metrics stay open), 404 not_found, 413 too_large (body over ``max_body_bytes``), 503 overloaded
(the queue is full; with Retry-After) or unavailable (a model is not loaded), 504 timeout (no
answer within ``timeout_s``). A 500 ("internal") is a bug.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Query, Request, Security
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.security import APIKeyHeader
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from genrec_spec.serve.batcher import MicroBatcher, QueueFullError
from genrec_spec.serve.config import ServeConfig
from genrec_spec.serve.generation import GenerateQuery, TextGenerator
from genrec_spec.serve.metrics import ServiceMetrics
from genrec_spec.serve.retrieval import Retriever
from genrec_spec.serve.schemas import (
    ErrorResponse,
    GenerateRequest,
    GenerateResponse,
    ReadyResponse,
    RecommendRequest,
    RecommendResponse,
    UsersResponse,
)

log = logging.getLogger("genrec_spec.serve")
API_KEY_HEADER = "X-API-Key"
ERRORS = {status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 422, 503, 504)}


class ServiceError(Exception):
    """A refusal with its HTTP status, error kind and a message saying what to do."""

    def __init__(self, status: int, kind: str, detail: str, headers: dict | None = None):
        super().__init__(detail)
        self.status, self.kind, self.detail, self.headers = status, kind, detail, headers


class BodyLimit:
    """ASGI middleware: 413 for a request body over `max_bytes`, by its Content-Length or, for
    a body sent without one (chunked), by counting while reading; at most max_bytes are held."""

    def __init__(self, app, max_bytes: int, refuse: Callable[[ServiceError], Response]):
        self.app, self.max_bytes, self.refuse = app, max_bytes, refuse

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        counted = not declared.isdigit()
        size = 0 if counted else int(declared)
        messages, more = [], True
        while more and size <= self.max_bytes:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":  # the client went away
                break
            size += len(message.get("body", b"")) if counted else 0
            more = message.get("more_body", False)
        if size > self.max_bytes:
            error = ServiceError(
                413,
                "too_large",
                f"the request body is over {self.max_bytes} bytes; send a smaller one (e.g. a "
                "shorter history: the model reads only the most recent items)",
            )
            return await self.refuse(error)(scope, receive, send)

        async def replay():
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)


def describe_problem(error: dict) -> str:
    """One line for one of pydantic's validation errors: where and what."""
    if error["type"] == "json_invalid":
        return f"malformed JSON at character {error['loc'][-1]}: {error['ctx']['error']}"
    where = ".".join(str(part) for part in error["loc"] if part != "body") or "body"
    return f"{where}: {error['msg']}"


def create_app(
    config: ServeConfig,
    retriever: Retriever,
    llm: str | None = None,
) -> FastAPI:
    """The service for a loaded recommender; `llm` (e.g. "smollm2") is loaded in the background
    after start-up (/readyz says when it is ready)."""
    metrics = ServiceMetrics()
    state: dict = {"llm": None, "llm_status": "loading" if llm else "off"}

    def run_recommend(key, queries) -> list[dict]:
        answers, stats = retriever.run(key, queries)
        passes = stats.get("target_passes", 0)
        metrics.model_call("recommend", key.decoder, passes, retriever.model.num_levels, passes)
        for how in ("exact", "extended", "missed"):
            if f"history_{how}" in stats:
                metrics.history_rows.labels(how).inc(stats[f"history_{how}"])
        return answers

    def run_generate(key, queries: list[GenerateQuery]) -> list[dict]:
        answers = [state["llm"].run(query) for query in queries]
        for answer in answers:
            stats = answer["stats"]
            metrics.model_call(
                "generate",
                answer["method"],
                stats["target_forwards"],
                stats["generated_tokens"],
                stats["row_steps"],
            )
        return answers

    async def load_in_background(name: str) -> None:
        try:
            state["llm"] = await asyncio.to_thread(TextGenerator.load, name)
            state["llm_status"] = "ready"
        except Exception as exc:  # reported by /readyz and /v1/generate; the rest keeps serving
            log.exception("loading the LLM %s failed", name)
            state["llm_status"] = f"failed: {type(exc).__name__}: {exc}"

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        def batcher(run, kind: str, max_batch: int, max_wait_s: float) -> MicroBatcher:
            observe = metrics.batch_size.labels(kind).observe
            b = MicroBatcher(
                run,
                max_batch=max_batch,
                max_wait_s=max_wait_s,
                max_queue=config.max_queue,
                on_batch=observe,
            )
            b.start()
            return b

        wait_s = config.max_wait_ms / 1e3
        state["recommend"] = batcher(run_recommend, "recommend", config.max_batch, wait_s)
        # One generation per model call: every request has its own seed and method.
        state["generate"] = batcher(run_generate, "generate", 1, 0.0)
        loading = asyncio.create_task(load_in_background(llm)) if llm else None
        yield
        if loading is not None:
            loading.cancel()
        await state["recommend"].stop()
        await state["generate"].stop()

    app = FastAPI(
        title="genrec_spec retrieval service",
        summary="Generative retrieval over Semantic IDs with speculative decoders",
        lifespan=lifespan,
    )

    def refuse(error: ServiceError) -> JSONResponse:
        metrics.errors.labels(error.kind).inc()
        body = {"kind": error.kind, "detail": error.detail}
        return JSONResponse(body, status_code=error.status, headers=error.headers)

    @app.exception_handler(ServiceError)
    async def on_service_error(request: Request, error: ServiceError) -> JSONResponse:
        return refuse(error)

    @app.exception_handler(RequestValidationError)
    async def on_invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        problems = "; ".join(describe_problem(e) for e in error.errors())
        return refuse(ServiceError(422, "invalid_request", f"invalid request: {problems}"))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        kind = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code, "http")
        detail = f"{error.detail}: {request.method} {request.url.path} (endpoints: /docs)"
        return refuse(ServiceError(error.status_code, kind, detail, error.headers))

    @app.exception_handler(Exception)
    async def on_bug(request: Request, error: Exception) -> JSONResponse:
        log.error("internal error on %s", request.url.path, exc_info=error)
        return refuse(ServiceError(500, "internal", f"internal error: {type(error).__name__}"))

    # Starlette runs the middleware added last outermost: the timing below sees the body
    # limit's refusals too.
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes, refuse=refuse)
    known_paths: set[str] = set()

    @app.middleware("http")
    async def time_requests(request: Request, call_next):
        start = time.perf_counter()
        response = await call_next(request)
        path = request.url.path if request.url.path in known_paths else "other"
        metrics.latency.labels(path, str(response.status_code)).observe(time.perf_counter() - start)
        return response

    api_key_header = APIKeyHeader(name=API_KEY_HEADER, auto_error=False)

    def check_key(key: str | None = Security(api_key_header)) -> None:
        if config.api_key is None:
            return
        if key is None or not secrets.compare_digest(key.encode(), config.api_key.encode()):
            raise ServiceError(
                401, "unauthorized", f"missing or wrong {API_KEY_HEADER} header; send the key"
            )

    async def submit(name: str, key, payload):
        try:
            return await state[name].submit(key, payload, config.timeout_s)
        except QueueFullError as exc:
            raise ServiceError(
                503,
                "overloaded",
                f"the service is overloaded ({exc}); retry after {config.retry_after_s} s",
                {"Retry-After": str(config.retry_after_s)},
            ) from None
        except TimeoutError:
            raise ServiceError(
                504,
                "timeout",
                f"no answer within the service's timeout of {config.timeout_s} s (the model is "
                "busy); retry later",
            ) from None
        except ValueError as exc:  # the model refused the request (e.g. an option value)
            raise ServiceError(400, "bad_request", str(exc)) from None

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"status": "ok"}

    @app.get("/readyz", response_model=ReadyResponse, responses={503: {"model": ReadyResponse}})
    async def readyz():
        components = {"recommender": "ready", "llm": state["llm_status"]}
        ready = all(status in ("ready", "off") for status in components.values())
        body = {"ready": ready, "components": components}
        return JSONResponse(body, status_code=200 if ready else 503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        for name in ("recommend", "generate"):
            metrics.waiting.labels(name).set(state[name].waiting)
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/users", response_model=UsersResponse, responses=ERRORS)
    async def users(
        limit: int = Query(1000, ge=1, le=100_000),
        offset: int = Query(0, ge=0),
        _: None = Security(check_key),
    ):
        ids = retriever.user_ids
        return {"users": ids[offset : offset + limit], "total": len(ids)}

    @app.post("/v1/recommend", response_model=RecommendResponse, responses=ERRORS)
    async def recommend(request: RecommendRequest, _: None = Security(check_key)):
        start = time.perf_counter()
        try:
            key, query = retriever.prepare(request)
        except ValueError as exc:
            raise ServiceError(400, "bad_request", str(exc)) from None
        answer = await submit("recommend", key, query)
        return answer | {"latency_ms": (time.perf_counter() - start) * 1e3}

    @app.post("/v1/generate", response_model=GenerateResponse, responses=ERRORS)
    async def generate(request: GenerateRequest, _: None = Security(check_key)):
        start = time.perf_counter()
        if llm is None:
            raise ServiceError(
                404,
                "not_found",
                "this service runs no LLM; start it with `genrec-spec serve --llm smollm2`",
            )
        if state["llm"] is None:
            raise ServiceError(
                503, "unavailable", f"the LLM {llm} is not ready ({state['llm_status']})"
            )
        if request.max_new_tokens > config.max_new_tokens:
            raise ServiceError(
                400,
                "bad_request",
                f"max_new_tokens={request.max_new_tokens} is over this service's limit of "
                f"{config.max_new_tokens}; ask for fewer",
            )
        method = "none" if request.method == "plain" else request.method
        query = GenerateQuery(
            request.prompt,
            request.max_new_tokens,
            method,
            request.temperature,
            request.seed,
            request.chat,
        )
        answer = await submit("generate", "generate", query)
        return answer | {"latency_ms": (time.perf_counter() - start) * 1e3}

    known_paths.update(route.path for route in app.routes)
    return app
