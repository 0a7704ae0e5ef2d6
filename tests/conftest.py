"""Fixtures shared by every test folder."""

import os
from pathlib import Path

import pytest

# Nothing can be fetched from a model hub here; a hub lookup would only waste time.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def ml100k_dir(tmp_path_factory) -> Path:
    """MovieLens-100K through the whole data pipeline, once per test session (~30 s cold; the
    item embeddings come from the user's embedding cache when it has them)."""
    from genrec_spec.data_pipelines.prepare import PrepareConfig, prepare

    out = tmp_path_factory.mktemp("prepared") / "ml-100k"
    prepare("ml-100k", out, PrepareConfig(progress=False))
    return out
