"""Recommender checkpoints: a folder with `model.safetensors` and `manifest.json`, written
atomically (a reader never sees a half-written checkpoint).

The manifest names the data the model was trained on (`data.data_hash` from the prepared
folder's manifest, and its path), the catalogue sizes needed to rebuild the model, the model and
training configs, metrics per epoch, versions and wall time. The weights hold the item codes
(and long IDs), so a checkpoint alone is enough to decode Semantic IDs back to item indices.
`load_model_and_data` loads a checkpoint with the prepared data it was trained on.
"""

from __future__ import annotations

import json
import platform
from dataclasses import asdict
from importlib import metadata
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from genrec_spec.data_pipelines.atomic import atomic_dir
from genrec_spec.models.recsys.config import ConfigError, RecommenderConfig, convert_flat_config
from genrec_spec.models.recsys.recommender import SemanticIdRecommender
from genrec_spec.recsys.data import PreparedData, load_prepared
from genrec_spec.recsys.errors import CheckpointError

CHECKPOINT_VERSION = 1
WEIGHTS = "model.safetensors"
MANIFEST = "manifest.json"


def save_checkpoint(
    out: Path,
    model: SemanticIdRecommender,
    manifest: dict,  # data / train config / metrics ...; the catalogue and model parts are added
    *,
    overwrite: bool = False,
) -> dict:
    """Write `out` atomically; returns the full manifest."""
    manifest = {
        "checkpoint_version": CHECKPOINT_VERSION,
        **manifest,
        "model_config": asdict(model.config),
        "catalogue": {
            "items": model.num_items,
            "codebook_sizes": model.codebook_sizes,
            "long_id_sizes": model.long_id_sizes,
        },
        "versions": versions(),
    }
    state = {name: t.detach().cpu().contiguous() for name, t in model.state_dict().items()}
    with atomic_dir(Path(out), overwrite=overwrite) as tmp:
        save_file(state, str(tmp / WEIGHTS))
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def load_checkpoint(
    path: Path | str, device: str | torch.device = "cpu"
) -> tuple[SemanticIdRecommender, dict]:
    """(model in eval mode on `device`, manifest)."""
    path = Path(path)
    for name in (MANIFEST, WEIGHTS):
        if not (path / name).is_file():
            raise CheckpointError(
                f"checkpoint folder {path} has no {name}",
                f"train one with `genrec-spec train --data DIR --out {path}`",
            )
    manifest = json.loads((path / MANIFEST).read_text())
    if manifest.get("checkpoint_version") != CHECKPOINT_VERSION:
        raise CheckpointError(
            f"{path} has checkpoint version {manifest.get('checkpoint_version')}, this code "
            f"reads version {CHECKPOINT_VERSION}",
            "retrain it with `genrec-spec train`",
        )
    try:  # manifests written before the component configs hold the flat form
        model_config = RecommenderConfig.from_dict(
            convert_flat_config(manifest["model_config"], manifest=True)
        )
    except ConfigError as err:
        raise CheckpointError(
            f"{path} was trained with model options this code does not know ({err.problem}; "
            "a newer or patched genrec_spec wrote it)",
            "load it with that version or retrain it with `genrec-spec train`",
        ) from err
    tensors = load_file(str(path / WEIGHTS))
    catalogue = manifest["catalogue"]
    model = SemanticIdRecommender(
        model_config,
        tensors["item_codes"],
        catalogue["codebook_sizes"],
        tensors.get("long_ids"),
        catalogue["long_id_sizes"],
    )
    model.load_state_dict(tensors)
    return model.to(device).eval(), manifest


def load_model_and_data(
    ckpt: Path | str, data_dir: Path | str | None = None
) -> tuple[SemanticIdRecommender, PreparedData]:
    """(model in eval mode, PreparedData) of a checkpoint; the data folder defaults to the one
    it was trained on and must be that data (same hash: item indices must mean the same items)."""
    model, manifest = load_checkpoint(ckpt)
    trained_on = manifest.get("data", {})
    data = load_prepared(data_dir if data_dir is not None else trained_on.get("path", ""))
    if trained_on.get("data_hash") != data.data_hash:
        raise CheckpointError(
            f"checkpoint {ckpt} was trained on data {trained_on.get('data_hash')} but "
            f"{data.path} holds data {data.data_hash}",
            "pass --data with the folder it was trained on",
        )
    if model.uses_times:  # its histories come with their timestamps
        data = data.with_times()
    return model, data


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for dist in ("genrec_spec", "torch", "torchrec", "fbgemm-gpu-cpu", "safetensors"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out
