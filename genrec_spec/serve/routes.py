"""The service's endpoints, as two routers: `health` (open: /healthz, /readyz, /metrics) and
`api` (/v1/*, behind the API key when the service has one). Each route reads the app's
`ServiceState` through the `Service` dependency."""

from __future__ import annotations

import secrets
import time
from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request, Security
from fastapi.responses import JSONResponse, Response
from fastapi.security import APIKeyHeader
from prometheus_client import CONTENT_TYPE_LATEST

from genrec_spec.serve.config import API_KEY_HEADER
from genrec_spec.serve.errors import ServiceError
from genrec_spec.serve.generation import GenerateQuery
from genrec_spec.serve.schemas import (
    ErrorResponse,
    GenerateRequest,
    GenerateResponse,
    ReadyResponse,
    RecommendRequest,
    RecommendResponse,
    UsersResponse,
)
from genrec_spec.serve.state import ServiceState

# The error responses every /v1/* route declares in the OpenAPI schema.
ERRORS = {status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 422, 503, 504)}


# The dependencies are coroutines, though they never wait: FastAPI runs a plain function
# dependency in its thread pool, a hop to another thread and back on every request.
async def service(request: Request) -> ServiceState:
    return request.app.state.service


Service = Annotated[ServiceState, Depends(service)]
api_key_header = APIKeyHeader(name=API_KEY_HEADER, auto_error=False)


async def check_key(state: Service, key: str | None = Security(api_key_header)) -> None:
    """401 unless the service has no key or the request's X-API-Key header is that key."""
    expected = state.config.api_key
    if expected is None:
        return
    if key is None or not secrets.compare_digest(key.encode(), expected.encode()):
        raise ServiceError(
            401, "unauthorized", f"missing or wrong {API_KEY_HEADER} header", "send the key"
        )


health = APIRouter()
api = APIRouter(dependencies=[Security(check_key)], responses=ERRORS)


@health.get("/healthz")
async def healthz() -> dict:
    return {"status": "ok"}


@health.get("/readyz", response_model=ReadyResponse, responses={503: {"model": ReadyResponse}})
async def readyz(state: Service):
    components = {"recommender": "ready", "llm": state.llm_status}
    ready = all(status in ("ready", "off") for status in components.values())
    body = {"ready": ready, "components": components}
    return JSONResponse(body, status_code=200 if ready else 503)


@health.get("/metrics")
async def prometheus_metrics(state: Service) -> Response:
    for name, batcher in state.batchers.items():
        state.metrics.waiting.labels(name).set(batcher.waiting)
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


@api.get("/v1/users", response_model=UsersResponse)
async def users(
    state: Service,
    limit: int = Query(1000, ge=1, le=100_000),
    offset: int = Query(0, ge=0),
):
    ids = state.retriever.user_ids
    return {"users": ids[offset : offset + limit], "total": len(ids)}


@api.post("/v1/recommend", response_model=RecommendResponse)
async def recommend(request: RecommendRequest, state: Service):
    start = time.perf_counter()
    batcher, source = "recommend", state.retriever
    if request.decoder == "llm":
        check_llm(state)
        if state.titles is None:
            raise ServiceError(
                400,
                "bad_request",
                "the service's data has no item titles for the llm decoder",
                "serve a prepared folder with titles (ml-100k, ml-1m, ...) or use another decoder",
            )
        batcher, source = "titles", state.titles
    try:
        key, query = source.prepare(request)
    except ValueError as exc:
        raise ServiceError.bad_request(exc) from None
    answer = await state.submit(batcher, key, query)
    return answer | {"latency_ms": (time.perf_counter() - start) * 1e3}


def check_generate(state: ServiceState, request: GenerateRequest) -> None:
    """404 without an LLM, 503 while it loads, 400 for more tokens than the service allows."""
    check_llm(state)
    limit = state.config.max_new_tokens
    if request.max_new_tokens > limit:
        raise ServiceError(
            400,
            "bad_request",
            f"max_new_tokens={request.max_new_tokens} is over this service's limit of {limit}",
            "ask for fewer",
        )


def check_llm(state: ServiceState) -> None:
    """404 without an LLM, 503 while it loads."""
    if state.llm_name is None:
        raise ServiceError(
            404,
            "not_found",
            "this service runs no LLM",
            "start it with `genrec-spec serve --llm smollm2`",
        )
    if state.llm is None:
        raise ServiceError(
            503,
            "unavailable",
            f"the LLM {state.llm_name} is not ready ({state.llm_status})",
            "retry when /readyz answers 200",
        )


@api.post("/v1/generate", response_model=GenerateResponse)
async def generate(request: GenerateRequest, state: Service):
    start = time.perf_counter()
    check_generate(state, request)
    query = GenerateQuery(
        request.prompt,
        request.max_new_tokens,
        "none" if request.method == "plain" else request.method,
        request.temperature,
        request.seed,
        request.chat,
        request.num_beams,
        request.num_return_sequences,
    )
    answer = await state.submit("generate", "generate", query)
    return answer | {"latency_ms": (time.perf_counter() - start) * 1e3}
