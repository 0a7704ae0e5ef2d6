"""The exception handlers that answer every failure with the JSON body
``{"kind": ..., "detail": ...}`` and its HTTP status.

Kinds and statuses: 400 bad_request, 401 unauthorized, 404 not_found, 405 method_not_allowed,
413 too_large, 422 invalid_request, 503 overloaded or unavailable, 504 timeout; 500 internal is a
bug. Every refusal is counted in the metrics' ``genrec_spec_errors_total{kind}``.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from genrec_spec.errors import GenrecError
from genrec_spec.serve.errors import ServiceError
from genrec_spec.serve.metrics import ServiceMetrics

log = logging.getLogger("genrec_spec.serve")


def refusal(metrics: ServiceMetrics, error: ServiceError) -> JSONResponse:
    """The JSON answer to a refusal, counted by kind."""
    metrics.errors.labels(error.kind).inc()
    body = {"kind": error.kind, "detail": error.detail}
    return JSONResponse(body, status_code=error.status, headers=error.headers)


def describe_problem(error: dict) -> tuple[str, str | None]:
    """One line for one of pydantic's validation errors, where and what, and the fix a
    schema's own check gave (None: a type or range error, whose fix is the schema)."""
    if error["type"] == "json_invalid":
        return f"malformed JSON at character {error['loc'][-1]}: {error['ctx']['error']}", None
    where = ".".join(str(part) for part in error["loc"] if part != "body") or "body"
    cause = error.get("ctx", {}).get("error")
    if isinstance(cause, GenrecError):  # a check of the schema's (pydantic wraps its message)
        return f"{where}: {cause.problem}", cause.fix
    return f"{where}: {error['msg']}", None


def _refuse(request: Request, error: ServiceError) -> JSONResponse:
    return refusal(request.app.state.service.metrics, error)


async def on_service_error(request: Request, error: ServiceError) -> JSONResponse:
    return _refuse(request, error)


async def on_invalid(request: Request, error: RequestValidationError) -> JSONResponse:
    described = [describe_problem(e) for e in error.errors()]
    problems = "; ".join(problem for problem, _ in described)
    schema = "send a body that follows the schema at /openapi.json"
    fix = "; ".join(dict.fromkeys(fix or schema for _, fix in described))  # each once, in order
    return _refuse(
        request, ServiceError(422, "invalid_request", f"invalid request: {problems}", fix)
    )


async def on_http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
    kind = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code, "http")
    problem = f"{error.detail}: {request.method} {request.url.path}"
    fix = "use one of the endpoints listed at /docs"
    return _refuse(request, ServiceError(error.status_code, kind, problem, fix, error.headers))


async def on_bug(request: Request, error: Exception) -> JSONResponse:
    log.error("internal error on %s", request.url.path, exc_info=error)
    problem = f"internal error: {type(error).__name__}"
    fix = "this is a bug in the service; report it with the service's log"
    return _refuse(request, ServiceError(500, "internal", problem, fix))


def add_exception_handlers(app: FastAPI) -> None:
    """Answer refusals, invalid bodies, unknown routes and bugs with the JSON error body."""
    app.add_exception_handler(ServiceError, on_service_error)
    app.add_exception_handler(RequestValidationError, on_invalid)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(Exception, on_bug)
