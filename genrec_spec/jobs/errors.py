"""The jobs' user-facing errors, each a `GenrecError` (a problem and its fix)."""

from genrec_spec.errors import GenrecError


class BatchInputError(GenrecError):
    """Bad arguments or users for the batch job."""


class RayAddressError(BatchInputError):
    """A --ray-address that is malformed, where nothing answers, or where something else does."""


class BatchOutputError(GenrecError):
    """An output folder the job must not write to (other job, other content, busy, unwritable)."""


class ReplayInputError(GenrecError):
    """Bad input to the replay: arms, checkpoints, the log file or the settings."""
