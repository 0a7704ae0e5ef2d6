"""The one user-facing error type: what was wrong, and how to fix it.

Every part of the library raises a subclass (`DataError`, `DecodeInputError`, `CheckpointError`,
...), so a caller can catch them all as `GenrecError` and still tell the parts apart. It is a
`ValueError`: every one means "the input was wrong", and code that caught `ValueError` keeps
working. This module imports nothing, so the lowest layers (kernels, models, data pipelines) can
use it.
"""


class GenrecError(ValueError):
    """Bad input. ``str(err)`` reads "<problem>. Fix: <fix>"; the CLI prints it as one line and
    exits 2, the service answers it with a 4xx body. ``problem`` and ``fix`` stay attributes."""

    def __init__(self, problem: str, fix: str) -> None:
        # Both go to the exception's args so the error pickles (worker processes re-raise it).
        super().__init__(problem, fix)
        self.problem = problem
        self.fix = fix

    def __str__(self) -> str:
        return f"{self.problem.rstrip('.')}. Fix: {self.fix}"
