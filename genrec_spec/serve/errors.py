"""The service's user-facing errors, each a `GenrecError` (a problem and its fix).

`ServeInputError` is a request the service cannot answer as asked, or a setting it cannot run
with; `ServiceError` is a refusal on its way to the client, with its HTTP status and error kind
(`serve.handlers` answers it with the JSON body ``{"kind": ..., "detail": str(error)}``).
"""

from __future__ import annotations

from genrec_spec.errors import GenrecError


class ServeInputError(GenrecError):
    """A request the service cannot answer as asked (unknown id, k out of range, bad option), or
    a service setting out of range."""


class ServiceError(GenrecError):
    """A refusal: its HTTP status, its error kind (bad_request, unauthorized, ...), and the problem
    and fix its body's detail reads."""

    def __init__(
        self, status: int, kind: str, problem: str, fix: str, headers: dict | None = None
    ) -> None:
        super().__init__(problem, fix)
        self.status, self.kind, self.headers = status, kind, headers

    def __reduce__(self):
        return type(self), (self.status, self.kind, self.problem, self.fix, self.headers)

    @property
    def detail(self) -> str:
        return str(self)

    @classmethod
    def bad_request(cls, error: ValueError) -> ServiceError:
        """400 for a request the model or the retriever refused."""
        if isinstance(error, GenrecError):
            return cls(400, "bad_request", error.problem, error.fix)
        return cls(400, "bad_request", str(error), "correct the request")
