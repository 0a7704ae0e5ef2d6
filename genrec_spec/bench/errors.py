"""The benchmarks' user-facing error (a `GenrecError`: a problem and its fix)."""

from genrec_spec.errors import GenrecError


class BenchError(GenrecError):
    """Benchmark settings that cannot run (a bad shape, a count below one, an unknown method)."""
