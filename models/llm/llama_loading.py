"""Read Llama checkpoints into (LlamaConfig, state dict in ``Llama``'s parameter names).

Two formats:
- llama.cpp GGUF: every tensor is dequantised to fp32 with the ``gguf`` package, and the rows
  of attn_q / attn_k are un-permuted (llama.cpp interleaves the two rotary halves of each head;
  ``Llama`` uses the Hugging Face rotate-half layout).
- Hugging Face folders: config.json plus one or more *.safetensors files.

Only plain Llama is accepted: rope scaling, biases or other architectures raise ``LlamaError``
rather than load into a model that would compute something else.
"""

import json
from pathlib import Path

import torch

from genrec_spec.models.llm.llama_config import LlamaConfig, LlamaError
from genrec_spec.models.llm.q4 import GROUP, Q4Codes

# Per-layer parameter names: ours -> (GGUF "blk.{i}." suffix, HF "model.layers.{i}." suffix).
LAYER_NAMES = {
    "attention_norm.weight": ("attn_norm.weight", "input_layernorm.weight"),
    "attention.wq.weight": ("attn_q.weight", "self_attn.q_proj.weight"),
    "attention.wk.weight": ("attn_k.weight", "self_attn.k_proj.weight"),
    "attention.wv.weight": ("attn_v.weight", "self_attn.v_proj.weight"),
    "attention.wo.weight": ("attn_output.weight", "self_attn.o_proj.weight"),
    "ffn_norm.weight": ("ffn_norm.weight", "post_attention_layernorm.weight"),
    "feed_forward.w1.weight": ("ffn_gate.weight", "mlp.gate_proj.weight"),
    "feed_forward.w3.weight": ("ffn_up.weight", "mlp.up_proj.weight"),
    "feed_forward.w2.weight": ("ffn_down.weight", "mlp.down_proj.weight"),
}
# Model-level names: ours -> (GGUF, HF). "output.weight" is absent with tied embeddings.
TOP_NAMES = {
    "tok_embeddings.weight": ("token_embd.weight", "model.embed_tokens.weight"),
    "norm.weight": ("output_norm.weight", "model.norm.weight"),
    "output.weight": ("output.weight", "lm_head.weight"),
}


def _our_names(config: LlamaConfig, fmt: int) -> dict[str, str]:
    """Checkpoint name -> our name, for fmt 0 (GGUF) or 1 (HF)."""
    prefix = ("blk.{}.", "model.layers.{}.")[fmt]
    names = {theirs[fmt]: ours for ours, theirs in TOP_NAMES.items()}
    if config.tie_embeddings:
        del names[TOP_NAMES["output.weight"][fmt]]
    for i in range(config.n_layers):
        for ours, theirs in LAYER_NAMES.items():
            names[prefix.format(i) + theirs[fmt]] = f"layers.{i}.{ours}"
    return names


def _rename(
    tensors: dict[str, torch.Tensor], names: dict[str, str], source: str, ignore: set[str]
) -> dict[str, torch.Tensor]:
    unknown = sorted(set(tensors) - set(names) - ignore)
    missing = sorted(set(names) - set(tensors))
    if unknown or missing:
        raise LlamaError(
            f"{source} does not hold a plain Llama model: unexpected tensors {unknown[:5]}, "
            f"missing tensors {missing[:5]}",
            "load a Llama checkpoint without extras: only those load here",
        )
    return {ours: tensors[theirs] for theirs, ours in names.items()}


def unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:  # [H*D, dim] -> [H*D, dim]
    """Undo llama.cpp's convert_hf_to_gguf permutation of q/k rows: per head it reshaped rows
    as (2, D/2) and transposed to (D/2, 2), interleaving the rotate-half pairs."""
    rows, cols = w.shape
    return w.reshape(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def _gguf_config(reader, path: str | Path) -> LlamaConfig:
    """The LlamaConfig of an open ``gguf.GGUFReader``, from its metadata and tensor shapes."""

    def field(key: str, default=None):
        f = reader.get_field(key)
        return default if f is None else f.contents()

    arch = field("general.architecture")
    if arch != "llama":
        raise LlamaError(f"{path} holds a {arch!r} model", "load a 'llama' GGUF file")
    if field("llama.rope.scaling.type", "none") != "none":
        raise LlamaError(
            f"{path} uses rope scaling, which this Llama does not implement",
            "load a Llama checkpoint without rope scaling",
        )
    shapes = {t.name: t.shape for t in reader.tensors}  # dimensions innermost first
    n_heads = field("llama.attention.head_count")
    config = LlamaConfig(
        vocab_size=int(shapes["token_embd.weight"][1]),
        dim=field("llama.embedding_length"),
        n_layers=field("llama.block_count"),
        n_heads=n_heads,
        n_kv_heads=field("llama.attention.head_count_kv", n_heads),
        hidden_dim=field("llama.feed_forward_length"),
        rope_theta=float(field("llama.rope.freq_base", 10000.0)),
        norm_eps=float(field("llama.attention.layer_norm_rms_epsilon")),
        max_seq_len=field("llama.context_length"),
        tie_embeddings="output.weight" not in shapes,
    )
    if field("llama.rope.dimension_count", config.head_dim) != config.head_dim:
        raise LlamaError(
            f"{path} rotates only part of each head (partial RoPE), which this Llama does not "
            "implement",
            "load a Llama checkpoint whose RoPE rotates whole heads",
        )
    return config


def read_gguf_config(path: str | Path) -> LlamaConfig:
    """The LlamaConfig of a GGUF file, from its metadata alone (no tensor is read)."""
    import gguf

    return _gguf_config(gguf.GGUFReader(str(path)), path)


def _unpermuted(config: LlamaConfig, name: str, w: torch.Tensor) -> torch.Tensor:
    """``w`` (rows of the parameter ``name``) with llama.cpp's q/k row permutation undone."""
    heads = {"attention.wq.weight": config.n_heads, "attention.wk.weight": config.n_kv_heads}
    suffix = name.split(".", 2)[-1]
    return unpermute_qk(w, heads[suffix]) if name.startswith("layers.") and suffix in heads else w


def read_gguf(path: str | Path) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    """Config and fp32 weights of a llama-architecture GGUF file."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    config = _gguf_config(reader, path)
    tensors = {
        t.name: torch.from_numpy(gguf.dequantize(t.data, t.tensor_type).copy())
        for t in reader.tensors
    }
    state = _rename(tensors, _our_names(config, 0), str(path), ignore=set())
    return config, {name: _unpermuted(config, name, w) for name, w in state.items()}


def read_gguf_q4(path: str | Path) -> dict[str, Q4Codes]:
    """The 4-bit matrices (Q4_0 and Q4_1) of a llama-architecture GGUF file as codes, in
    ``Llama``'s parameter names (q/k rows un-permuted as ``read_gguf`` does), without
    dequantising: what ``read_gguf`` turns into fp32, so ``codes.dequantize()`` equals its
    weights exactly. Tensors stored otherwise (norms, a Q8_0 embedding table, k-quants) are
    left out."""
    import gguf
    import numpy as np

    q4 = {gguf.GGMLQuantizationType.Q4_0: 18, gguf.GGMLQuantizationType.Q4_1: 20}  # block bytes
    reader = gguf.GGUFReader(str(path))
    config = _gguf_config(reader, path)
    names = _our_names(config, 0)
    out = {}
    for t in reader.tensors:
        if t.tensor_type not in q4 or t.name not in names:
            continue
        n, k = int(t.shape[1]), int(t.shape[0])  # GGUF lists dimensions innermost first
        # A block of 32 weights: an fp16 scale d, for Q4_1 an fp16 minimum m, then 16 bytes of
        # codes c (low nibbles: the block's first 16 weights, high nibbles: the last 16); the
        # weights are c * d + m (Q4_1) or (c - 8) * d (Q4_0: m = -8 d).
        blocks = np.ascontiguousarray(t.data).reshape(-1, q4[t.tensor_type])
        halves = torch.from_numpy(blocks[:, :4].copy().view(np.float16)).float()  # [blocks, 2]
        scales = halves[:, 0]
        mins = halves[:, 1] if t.tensor_type == gguf.GGMLQuantizationType.Q4_1 else -8 * scales
        nibbles = torch.from_numpy(blocks[:, -16:].copy()).to(torch.int32)  # [blocks, 16]
        codes = torch.cat([nibbles & 15, nibbles >> 4], dim=1).reshape(n, k)
        parts = (codes, scales.reshape(n, k // GROUP), mins.reshape(n, k // GROUP))
        ours = names[t.name]
        out[ours] = Q4Codes(*(_unpermuted(config, ours, p) for p in parts))
    return out


def read_hf(folder: str | Path) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    """Config and weights of a Hugging Face Llama folder (config.json + *.safetensors)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not (folder / "config.json").is_file() or not files:
        raise LlamaError(
            f"{folder} must hold config.json and *.safetensors weights",
            "pass a Hugging Face model folder (e.g. written by save_pretrained)",
        )
    hf = json.loads((folder / "config.json").read_text())
    rope = hf.get("rope_parameters") or {}  # transformers >= 5 nests rope settings here
    rope_type = rope.get("rope_type", (hf.get("rope_scaling") or {}).get("rope_type", "default"))
    if hf.get("model_type") != "llama" or rope_type != "default":
        raise LlamaError(
            f"{folder} holds model_type {hf.get('model_type')!r} with rope type {rope_type!r}",
            "load a plain Llama (default RoPE): only plain Llama loads here",
        )
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise LlamaError(
            f"{folder} uses attention/MLP biases, which this Llama does not have",
            "load a Llama checkpoint without biases",
        )
    n_heads = hf["num_attention_heads"]
    config = LlamaConfig(
        vocab_size=hf["vocab_size"],
        dim=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        hidden_dim=hf["intermediate_size"],
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        norm_eps=float(hf["rms_norm_eps"]),
        max_seq_len=hf["max_position_embeddings"],
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )
    if hf.get("head_dim", config.head_dim) != config.head_dim:
        raise LlamaError(
            f"{folder} sets head_dim != hidden_size / heads, which this Llama does not implement",
            "load a checkpoint whose head_dim is hidden_size / num_attention_heads",
        )
    tensors = {}
    for file in files:
        tensors.update(load_file(file))
    # A tied checkpoint may still store lm_head (a copy of the embeddings): ignore it.
    ignore = {"lm_head.weight"} if config.tie_embeddings else set()
    return config, _rename(tensors, _our_names(config, 1), str(folder), ignore)


def to_hf(model: torch.nn.Module):  # a native Llama -> transformers.LlamaForCausalLM
    """The native model as a transformers ``LlamaForCausalLM`` holding the same weight tensors
    (no copy), for transformers' own generate (e.g. as its ``assistant_model``)."""
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers import LlamaForCausalLM

    c = model.config
    hf_config = HFLlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.dim,
        intermediate_size=c.hidden_dim,
        num_hidden_layers=c.n_layers,
        num_attention_heads=c.n_heads,
        num_key_value_heads=c.n_kv_heads,
        head_dim=c.head_dim,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
        rms_norm_eps=c.norm_eps,
        max_position_embeddings=c.max_seq_len,
        tie_word_embeddings=c.tie_embeddings,
    )
    hf_names = {ours: theirs for theirs, ours in _our_names(c, 1).items()}
    state = {hf_names[name]: weight for name, weight in model.state_dict().items()}
    if c.tie_embeddings:  # transformers lists the tied head under its own name too
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    dtype = model.tok_embeddings.weight.dtype
    hf = LlamaForCausalLM(hf_config).to(dtype)
    hf.load_state_dict(state, assign=True)
    hf.tie_weights()
    return hf.eval()
