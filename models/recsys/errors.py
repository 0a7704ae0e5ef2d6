"""The recommender model's input error."""

from genrec_spec.errors import GenrecError


class RecommenderInputError(GenrecError):
    """Bad input to the recommender (ids out of range, malformed offsets or trees)."""
