"""The FastAPI app of the online retrieval service: `create_app(config, retriever, llm)`.

Endpoints (request and response bodies in `serve.schemas`; the schema is at /openapi.json):

- ``POST /v1/recommend``: top-k raw item ids for a known ``user_id`` or a ``history`` of raw
  item ids, by any decoder; concurrent requests share decoder calls (`serve.batcher`); decoder
  ``llm`` (with ``--llm``, on data with titles) has the LLM name the items (`serve.titles`);
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

import sys
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI

from genrec_spec.memory import keep_freed_memory
from genrec_spec.serve.config import API_KEY_ENV, ServeConfig, is_loopback
from genrec_spec.serve.handlers import add_exception_handlers
from genrec_spec.serve.middleware import BodyLimit, TimeRequests
from genrec_spec.serve.retrieval import Retriever
from genrec_spec.serve.routes import api, health
from genrec_spec.serve.state import ServiceState


@asynccontextmanager
async def lifespan(app: FastAPI):
    """Start the batchers (and the LLM's loading) with the server; stop them with it."""
    app.state.service.start()
    yield
    await app.state.service.stop()


def create_app(
    config: ServeConfig,
    retriever: Retriever,
    llm: str | None = None,
) -> FastAPI:
    """The service for a loaded recommender; `llm` (e.g. "smollm2") is loaded in the background
    after start-up (/readyz says when it is ready)."""
    app = FastAPI(
        title="genrec_spec retrieval service",
        summary="Generative retrieval over Semantic IDs with speculative decoders",
        lifespan=lifespan,
    )
    state = ServiceState(config, retriever, llm)
    app.state.service = state
    add_exception_handlers(app)
    # Starlette runs the middleware added last outermost: the timing sees the body limit's
    # refusals too.
    known_paths: set[str] = set()  # the paths the latency histogram names (filled below)
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes, metrics=state.metrics)
    app.add_middleware(TimeRequests, metrics=state.metrics, known_paths=known_paths)
    own = {getattr(route, "path", None) for route in app.routes}  # /docs, /openapi.json, ...
    for router in (health, api):
        app.include_router(router)
        own |= {route.path for route in router.routes}
    known_paths |= own - {None}
    return app


def run_service(
    config: ServeConfig,
    ckpt: Path | str,
    data_dir: Path | str | None = None,  # default: the folder the checkpoint was trained on
    llm: str | None = None,
    *,
    log_level: str = "info",
    access_log: bool = False,
) -> None:
    """Load the recommender (a bad checkpoint or data folder fails here, before anything is
    served), then serve on config.host:config.port with uvicorn until stopped."""
    import torch
    import uvicorn

    torch.set_num_threads(config.threads)
    keep_freed_memory()  # a serving process decodes batch after batch (genrec_spec.memory)
    retriever = Retriever.load(ckpt, data_dir, config.max_k, config.history_cache_mb << 20)
    if config.api_key is None and not is_loopback(config.host):
        print(
            f"warning: serving on {config.host} without an API key; anyone who can reach it "
            f"can use it (set --api-key or ${API_KEY_ENV})",
            file=sys.stderr,
        )
    app = create_app(config, retriever, llm=llm)
    uvicorn.run(app, host=config.host, port=config.port, log_level=log_level, access_log=access_log)
