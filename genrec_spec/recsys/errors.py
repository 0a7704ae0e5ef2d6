"""The recommender side's user-facing errors (each a `GenrecError`: a problem and its fix)."""

from genrec_spec.errors import GenrecError


class RecommendInputError(GenrecError):
    """Bad input to `recommend` (histories, k, decoder name or options)."""


class DecodeOptionError(GenrecError):
    """A decoder option that cannot work (beam width < k, k < 1, a mismatched trie, ...)."""


class MetricInputError(GenrecError):
    """Ranks, lists or cut-offs whose ranking metrics would be wrong."""


class CheckpointError(GenrecError):
    """A checkpoint folder that cannot be read, or data that does not match it."""


class ResumeError(GenrecError):
    """A training resume state that cannot be used: unasked for, unreadable, or left by another
    run (another config, data or number of processes)."""
