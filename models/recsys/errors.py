"""The recommender model's input error."""


class RecommenderInputError(ValueError):
    """Bad input to the recommender (ids out of range, malformed offsets or trees)."""
