"""The project's cache folder: slow conversions, trained drafters, timed pass costs, embeddings.

A bottom module like `genrec_spec.errors`: it imports nothing of the project, so every layer
(kernels, models, data pipelines, the core, the products) may use it.
"""

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$GENREC_SPEC_CACHE`` if set (and not empty), else ``~/.cache/genrec_spec``."""
    env = os.environ.get("GENREC_SPEC_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "genrec_spec"
