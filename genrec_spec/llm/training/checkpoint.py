"""Drafter checkpoints: a folder holding ``weights.safetensors`` and ``manifest.json``, bound to
the target it was trained for.

The manifest records the drafter's kind, its target (name, widths and a fingerprint of the
output layer the drafter reads through), the training data's key, the settings, the loss, the
held-out acceptance and the command that rebuilds the folder. Every file is written under a
temporary name and renamed into place, the manifest last: a folder with a manifest is complete.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from genrec_spec.core.types import DecodeInputError

FORMAT = 1  # bumped when the folder layout changes
WEIGHTS, MANIFEST = "weights.safetensors", "manifest.json"


class DrafterError(DecodeInputError):
    """A drafter folder that is missing, incomplete or made for another target."""


def output_weight(model: Any) -> Tensor:  # [V, D]
    """The native Llama's LM head (the token embeddings when they are tied)."""
    from genrec_spec.models.llm.llama import Llama

    if not isinstance(model, Llama):
        raise DrafterError(
            f"trained drafters attach to the project's native Llama, got {type(model).__name__}",
            "load the target with genrec_spec.models.llm.llama.Llama (e.g. models.smollm2)",
        )
    return model.tok_embeddings.weight if model.output is None else model.output.weight


def target_info(model: Any) -> dict[str, Any]:
    """Widths of the target and a fingerprint of its config, output layer and final norm, taken
    in bfloat16 so fp32 and bf16 copies of the same weights agree."""
    weight = output_weight(model)
    digest = hashlib.sha256(repr(model.config).encode())
    for tensor in (weight, model.norm.weight):
        as_bf16 = tensor.detach().to(torch.bfloat16).cpu().contiguous()
        digest.update(as_bf16.view(torch.int16).numpy().tobytes())
    config = model.config
    return {
        "dim": config.dim,
        "vocab_size": config.vocab_size,
        "n_layers": config.n_layers,
        "fingerprint": digest.hexdigest()[:16],
    }


def write_atomically(path: Path, write: Callable[[Path], None]) -> None:
    """``write(temporary path)``, then rename it to ``path``: readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def save_drafter(
    folder: Path, tensors: dict[str, Tensor], manifest: dict[str, Any]
) -> dict[str, Any]:
    """Write the weights, then the manifest with the folder format added; returns the latter as
    written (JSON types: a tuple comes back as a list, as load_drafter reads it)."""
    folder = Path(folder)
    weights = {name: t.detach().cpu().contiguous() for name, t in tensors.items()}
    write_atomically(folder / WEIGHTS, lambda tmp: save_file(weights, str(tmp)))
    manifest = {"format": FORMAT, **manifest}
    text = json.dumps(manifest, indent=2) + "\n"
    write_atomically(folder / MANIFEST, lambda tmp: tmp.write_text(text))
    return json.loads(text)


# Decoding methods that read another method's drafter: EAGLE-2 differs from EAGLE-1 only in the
# tree it drafts (dynamic, not static), so it decodes with the EAGLE drafter's weights. The
# distilled method decodes with the trained draft model, kind "draft" (the method name "draft" is
# the untrained layer-skipped copy).
SHARED_DRAFTERS = {"eagle2": "eagle", "distilled": "draft"}


def drafter_kind(method: str) -> str:
    """The kind of drafter a decoding method (or ``train-drafter --kind``) loads or trains."""
    return SHARED_DRAFTERS.get(method, method)


def default_folder(kind: str) -> Path:
    """Where ``train-drafter`` saves and ``generate`` looks without a folder given:
    ``$GENREC_SPEC_CACHE/drafters/<kind>`` (or under ``~/.cache/genrec_spec``)."""
    from genrec_spec.cache import cache_dir

    return cache_dir() / "drafters" / kind


def train_command(kind: str, folder: Path, model_name: str) -> str:
    return f"genrec-spec train-drafter --model {model_name} --kind {kind} --out {folder}"


def load_drafter(
    folder: Path, kind: str, model: Any, model_name: str = "smollm2"
) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """The weights and manifest of a ``kind`` drafter trained for ``model``; a clear error (with
    the command that trains one) when the folder is missing or was made for something else."""
    folder = Path(folder)
    retrain = f"train one with `{train_command(kind, folder, model_name)}`"
    if not (folder / MANIFEST).is_file() or not (folder / WEIGHTS).is_file():
        raise DrafterError(f"no trained {kind} drafter in {folder}", retrain)
    manifest = json.loads((folder / MANIFEST).read_text())
    if manifest.get("kind") != kind or manifest.get("format") != FORMAT:
        raise DrafterError(
            f"{folder} holds a {manifest.get('kind')} drafter (format {manifest.get('format')}), "
            f"not a {kind} drafter of format {FORMAT}",
            retrain,
        )
    want, have = manifest["target"], target_info(model)
    widths = ("dim", "vocab_size", "n_layers")
    if any(want[key] != have[key] for key in widths):
        raise DrafterError(
            f"the drafter in {folder} was trained for a target with "
            + ", ".join(f"{key} {want[key]}" for key in widths)
            + "; this target has "
            + ", ".join(f"{key} {have[key]}" for key in widths),
            f"use the target it was trained for, or {retrain}",
        )
    if want["fingerprint"] != have["fingerprint"]:
        raise DrafterError(
            f"the drafter in {folder} was trained for other weights of the same shape "
            f"(fingerprint {want['fingerprint']}, this target {have['fingerprint']})",
            f"use the target it was trained for, or {retrain}",
        )
    return load_file(str(folder / WEIGHTS)), manifest
