"""The one error type of the data side: what was wrong, and how to fix it."""


class DataError(ValueError):
    """Bad dataset input. ``str(err)`` reads "<problem>. Fix: <fix>"; the CLI prints it and exits
    non-zero. ``problem`` and ``fix`` stay available as attributes."""

    def __init__(self, problem: str, fix: str) -> None:
        # Both go to ValueError's args so the error pickles (worker processes re-raise it).
        super().__init__(problem, fix)
        self.problem = problem
        self.fix = fix

    def __str__(self) -> str:
        return f"{self.problem.rstrip('.')}. Fix: {self.fix}"
