"""Defaults of the online retrieval service (``genrec-spec serve``), in one place."""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass

from genrec_spec.serve.errors import ServeInputError

API_KEY_ENV = "GENREC_SPEC_API_KEY"  # where `serve` and `loadtest` read the key by default
API_KEY_HEADER = "X-API-Key"  # the request header that carries it


@dataclass(frozen=True)
class ServeConfig:
    """How the service listens, batches, sheds load and limits requests."""

    host: str = "127.0.0.1"  # bind address; loopback unless the operator says otherwise
    port: int = 8080
    api_key: str | None = None  # when set, /v1/* need the header X-API-Key with this value
    max_batch: int = 32  # most /v1/recommend requests decoded in one decoder call
    # the longest the first request of a batch waits for company (it runs at once when the
    # company it expects is there: `serve.batcher`)
    max_wait_ms: float = 5.0
    max_queue: int = 256  # requests waiting for the model beyond this are refused with 503
    timeout_s: float = 5.0  # a request not answered in this time gets 504 (queue wait included)
    max_body_bytes: int = 64 * 1024  # larger request bodies get 413
    max_k: int = 200  # the longest list a request may ask for (and at most the catalogue)
    max_new_tokens: int = 256  # the most tokens one /v1/generate request may ask for
    retry_after_s: int = 1  # the Retry-After header of an overload 503
    threads: int = 1  # torch CPU threads of the model worker (1 is fastest for small models)
    history_cache_mb: int = 256  # encoded user histories kept across requests (0: off)

    def __post_init__(self) -> None:
        checks = {
            "max_batch": self.max_batch >= 1,
            "max_wait_ms": self.max_wait_ms >= 0,
            "max_queue": self.max_queue >= 1,
            "timeout_s": self.timeout_s > 0,
            "max_body_bytes": self.max_body_bytes >= 1024,
            "max_k": self.max_k >= 1,
            "max_new_tokens": self.max_new_tokens >= 1,
            "retry_after_s": self.retry_after_s >= 1,
            "threads": 1 <= self.threads <= (os.cpu_count() or 1),
            "history_cache_mb": self.history_cache_mb >= 0,
            "port": 0 <= self.port <= 65535,
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            values = ", ".join(f"{name}={getattr(self, name)!r}" for name in bad)
            raise ServeInputError(
                f"invalid service setting(s) {values}",
                "batch, queue, k, token and thread limits must be >= 1 (threads at most the "
                "machine's cores), waits >= 0, the "
                "timeout > 0, the body limit >= 1024 bytes and the port in 0..65535",
            )


def is_loopback(host: str) -> bool:
    """Whether `host` names this machine only ("localhost" or a loopback address)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
