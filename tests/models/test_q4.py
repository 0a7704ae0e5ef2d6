"""4-bit weights (``models.q4``): Q4_1 codes round-trip, the packed layout computes the
dequantised matrix's product up to fp32 rounding (any N, padded to the kernel's 16 rows), and
the shipped SmolLM2 GGUF's codes are exactly the weights the fp32 target was loaded with."""

import pytest
import torch

from genrec_spec.kernels.q4 import rounded_input
from genrec_spec.models.llm.q4 import GROUP, Q4Codes, Q4Error, cat_codes, quantize_q4


def random_matrix(n: int, k: int, seed: int) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed))


def test_quantize_round_trip_within_half_a_step():
    w = random_matrix(24, 64, 0)
    w[3, :GROUP] = 0.7  # a constant group: the scale stays finite
    q = quantize_q4(w)
    assert q.codes.shape == (24, 64) and q.scales.shape == q.mins.shape == (24, 64 // GROUP)
    assert int(q.codes.min()) >= 0 and int(q.codes.max()) <= 15
    err = (q.dequantize() - w).abs().view(24, 2, GROUP).amax(-1)  # [N, groups]
    assert bool((err <= q.scales / 2 + 1e-6).all())
    assert torch.equal(q.scales.half().float(), q.scales)  # fp16 values, as the kernel reads
    assert torch.equal(q.mins.half().float(), q.mins)


@pytest.mark.parametrize("n", [16, 40, 61], ids=["tile", "padded", "odd"])
def test_packed_product_matches_dequantised(n):
    q = quantize_q4(random_matrix(n, 96, 1))
    x = random_matrix(3, 96, 2)  # M = 3 rows
    out = q.pack()(x)
    assert out.shape == (3, n) and out.dtype == torch.float32
    # x is rounded as the CPU's path rounds it, the rest is exact up to fp32 sums of values of
    # magnitude ~10
    expected = rounded_input(x) @ q.dequantize().double().T
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=1e-4)


def test_cat_codes_stacks_outputs():
    parts = [quantize_q4(random_matrix(n, 64, s)) for s, n in enumerate((32, 16, 16))]
    x = random_matrix(2, 64, 9)
    fused = cat_codes(parts).pack()(x)
    torch.testing.assert_close(fused, torch.cat([p.pack()(x) for p in parts], dim=1))


def test_bad_shape_is_refused():
    with pytest.raises(Q4Error, match="groups of 32"):
        quantize_q4(random_matrix(16, 48, 0))


@pytest.mark.slow
def test_smollm2_codes_are_the_loaded_weights():
    """Every Q4_1 matrix of the shipped file, q/k rows un-permuted, dequantises to exactly the
    fp32 weight ``read_gguf`` gives: the draft holds the target's own weights."""
    from genrec_spec.models.llm.llama_loading import read_gguf, read_gguf_q4
    from genrec_spec.models.llm.smollm2 import smollm2_gguf_path

    codes = read_gguf_q4(smollm2_gguf_path())
    _, weights = read_gguf(smollm2_gguf_path())
    assert len(codes) == 7 * 30  # q, k, v, o, gate, up, down of 30 layers; not the Q8_0 table
    assert all(isinstance(c, Q4Codes) for c in codes.values())
    assert all(torch.equal(c.dequantize(), weights[name]) for name, c in codes.items())


def write_tiny_gguf(path, model) -> None:
    """``model`` as a llama.cpp GGUF file: layer 0's matrices as Q4_0, the others' as Q4_1, the
    embeddings as Q8_0 and the norms as F32, q/k rows permuted as llama.cpp's converter does."""
    import gguf

    from genrec_spec.models.llm.llama_loading import LAYER_NAMES, TOP_NAMES

    c = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(c.max_seq_len)
    writer.add_embedding_length(c.dim)
    writer.add_block_count(c.n_layers)
    writer.add_feed_forward_length(c.hidden_dim)
    writer.add_head_count(c.n_heads)
    writer.add_head_count_kv(c.n_kv_heads)
    writer.add_rope_freq_base(c.rope_theta)
    writer.add_layer_norm_rms_eps(c.norm_eps)
    names = {ours: theirs[0] for ours, theirs in TOP_NAMES.items()}
    for i in range(c.n_layers):
        names |= {
            f"layers.{i}.{ours}": f"blk.{i}.{theirs[0]}" for ours, theirs in LAYER_NAMES.items()
        }
    heads = {"attention.wq.weight": c.n_heads, "attention.wk.weight": c.n_kv_heads}
    for ours, weight in model.state_dict().items():
        w = weight.detach().float()
        suffix = ours.split(".", 2)[-1]
        if suffix in heads:  # llama.cpp interleaves the rotary halves of each head's rows
            h = heads[suffix]
            w = w.reshape(h, 2, w.shape[0] // h // 2, -1).transpose(1, 2).reshape(w.shape)
        if w.dim() == 1:
            writer.add_tensor(names[ours], w.numpy())
            continue
        kind = gguf.GGMLQuantizationType
        qtype = (
            kind.Q8_0
            if ours == "tok_embeddings.weight"
            else (kind.Q4_0 if ours.startswith("layers.0.") else kind.Q4_1)
        )
        data = gguf.quants.quantize(w.numpy(), qtype)
        writer.add_tensor(names[ours], data, raw_shape=data.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_q4_0_and_q4_1_codes_draft_their_model(tmp_path):
    """A llama.cpp file of a tiny model with Q4_0 and Q4_1 matrices: the codes read back are
    exactly the weights the target loads, and their draft decodes to plain greedy decoding's
    tokens (B = 3, uneven prompts), accepting deep."""
    from genrec_spec import ControllerConfig, generate
    from genrec_spec.llm.proposers.quantized import QuantizedSelfProposer
    from genrec_spec.models.llm.llama import Llama, LlamaConfig
    from genrec_spec.models.llm.llama_loading import read_gguf_q4
    from genrec_spec.models.llm.quantized_draft import QuantizedDraft

    config = LlamaConfig(
        64, 64, 2, 4, 2, 128, rope_theta=500.0, max_seq_len=64, tie_embeddings=True
    )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        source = Llama(config).eval()
    with torch.no_grad():
        for p in source.parameters():
            p.mul_(3.0)  # peaked next-token distributions
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, source)
    target = Llama.from_gguf(path)
    codes = read_gguf_q4(path)
    assert len(codes) == 7 * 2
    assert all(torch.equal(c.dequantize(), target.get_parameter(n)) for n, c in codes.items())
    prompts = [[5, 9, 2, 33, 7, 1, 8], [4], [12, 3, 3, 40, 22]]
    plain = generate(target, prompts, max_new_tokens=20).tolist()
    proposer = QuantizedSelfProposer(QuantizedDraft.from_gguf(target, path), k=4)
    out = generate(
        target,
        prompts,
        max_new_tokens=20,
        proposer=proposer,
        controller=ControllerConfig(adaptive=False),
    )
    assert out.tolist() == plain
    assert out.stats.mean_accepted_length > 3.0
