"""The error type of the data side."""

from genrec_spec.errors import GenrecError


class DataError(GenrecError):
    """Bad dataset input (unknown dataset, missing files or columns, malformed values)."""
