"""Fixtures shared by every test folder."""

import os
from pathlib import Path

import pytest
import torch

# Nothing can be fetched from a model hub here; a hub lookup would only waste time.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# Without a CUDA GPU the Triton kernel runs in the interpreter. The switch is read when triton is
# imported, and torch, torchrec or fbgemm may import triton while other test folders are
# collected, so it is set here, in the first conftest pytest loads. It is process-wide; that is
# harmless because on CPU only the kernel tests ask for backend="triton".
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def ml100k_dir(tmp_path_factory) -> Path:
    """MovieLens-100K through the whole data pipeline, once per test session (~30 s cold; the
    item embeddings come from the user's embedding cache when it has them)."""
    from genrec_spec.data_pipelines.prepare import PrepareConfig, prepare

    out = tmp_path_factory.mktemp("prepared") / "ml-100k"
    prepare("ml-100k", out, PrepareConfig(progress=False))
    return out
