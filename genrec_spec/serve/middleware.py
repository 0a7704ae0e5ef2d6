"""The service's middleware: the request-body limit (413) and the request-latency histogram."""

from __future__ import annotations

import time

from genrec_spec.serve.errors import ServiceError
from genrec_spec.serve.handlers import refusal
from genrec_spec.serve.metrics import ServiceMetrics


class BodyLimit:
    """ASGI middleware: 413 for a request body over `max_bytes`, by its Content-Length or, for
    a body sent without one (chunked), by counting while reading; at most max_bytes are held."""

    def __init__(self, app, max_bytes: int, metrics: ServiceMetrics):
        self.app, self.max_bytes, self.metrics = app, max_bytes, metrics

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
                f"the request body is over {self.max_bytes} bytes",
                "send a smaller one (e.g. a shorter history: the model reads only the most "
                "recent items)",
            )
            return await refusal(self.metrics, error)(scope, receive, send)

        async def replay():
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)


class TimeRequests:
    """ASGI middleware: observe each request's latency by path (unknown paths as "other") and
    status, from the first byte read to the response's end. Plain ASGI: Starlette's HTTP
    middleware (`BaseHTTPMiddleware`) runs the app in a task of its own and streams its response
    through, which cost the event loop about a millisecond a request."""

    def __init__(self, app, metrics: ServiceMetrics, known_paths: set[str]):
        self.app, self.metrics, self.known_paths = app, metrics, known_paths

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), 500  # (an app that raised: the server answers 500)

        async def sending(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            path = scope["path"] if scope["path"] in self.known_paths else "other"
            latency = self.metrics.latency.labels(path, str(status))
            latency.observe(time.perf_counter() - start)
