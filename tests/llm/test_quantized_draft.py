"""Quantised self-speculation (the target's own weights at 4 bits drafting on its cache) is
lossless: greedy output equals plain greedy decoding at batch 3 with uneven prompts, and
rejection sampling reproduces the target's exact distribution. The draft's logits are the
target's up to the rounding of the matmuls' inputs (bfloat16, or int8 on the AVX2 path) when its
codes are the target's weights, at every draft offset and for every row of a ragged batch."""

import pytest
import torch

from genrec_spec import CallableTarget, ControllerConfig, SamplingParams, generate
from genrec_spec.core.types import DecodeInputError
from genrec_spec.kernels.q4 import path
from genrec_spec.llm.proposers.quantized import QuantizedSelfProposer
from genrec_spec.models.llm.q4 import quantize_q4
from genrec_spec.models.llm.quantized_draft import QuantizedDraft
from genrec_spec.models.llm.smollm2 import smollm2_gguf_path

FIXED = ControllerConfig(adaptive=False)


def on_codes(model):
    """``model`` with every layer matrix and the LM head replaced by its own 4-bit rounding,
    as a GGUF target is: the draft's codes then hold exactly the target's weights."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and name != "tok_embeddings.weight":
                p.copy_(quantize_q4(p).dequantize())
    return model


def test_draft_logits_are_the_targets(kit):
    """Rows of uneven length, three draft tokens past each row's committed length: each step's
    logits match the target's at that position (the target scores the same chain in one pass)."""
    model = on_codes(kit.tiny_llama(61, seed=3))
    draft = QuantizedDraft(model)
    prompts = [[5, 9, 2, 33, 7, 1], [4, 60], [12, 3, 3, 40]]  # B = 3
    chain = torch.tensor([[8, 13, 21, 34], [1, 2, 3, 4], [40, 41, 42, 43]])  # [B, 4]
    cache = model.new_cache(3, 16)
    width = max(map(len, prompts))
    ids = torch.tensor([p + [0] * (width - len(p)) for p in prompts])
    model(ids, cache)
    cache.commit(torch.arange(width).expand(3, width), torch.tensor([len(p) for p in prompts]))
    steps = torch.stack([draft.step(chain[:, j], cache, j) for j in range(4)], dim=1)
    expected = model(chain, cache)  # [B, 4, V]: the chain after each row's own prompt
    # int8 inputs (32 values a scale) round this tiny model's activations more than bfloat16's
    atol = 0.8 if path() == "avx2" else 0.3
    torch.testing.assert_close(steps, expected, rtol=0.05, atol=atol)
    assert bool((steps.argmax(-1) == expected.argmax(-1)).float().mean() > 0.9)


@pytest.mark.parametrize("controller", [FIXED, None], ids=["full-depth", "adaptive"])
def test_greedy_equals_plain(kit, controller):
    """On a target whose weights are 4-bit codes, as SmolLM2's are: drafts accepted deep."""
    model = on_codes(kit.tiny_llama(61, seed=0))
    proposer = QuantizedSelfProposer(QuantizedDraft(model), k=5)
    kit.assert_greedy(model, proposer, controller, min_accepted=3.0, deep=4)


@pytest.mark.parametrize(
    "sampling",
    [SamplingParams(1.0), SamplingParams(0.8, top_k=5), SamplingParams(1.2, top_p=0.8)],
    ids=["T1", "topk", "topp"],
)
def test_sampling_is_exact(kit, sampling):
    model = kit.exact_target()
    kit.assert_exact(model, QuantizedSelfProposer(QuantizedDraft(model), k=3), sampling)


def test_draft_cost_is_measured_once_per_batch_size(kit, tmp_path, monkeypatch):
    """A real timing gives a positive ratio; it is kept in a file per batch size (and machine,
    threads, shapes) and read back by another draft of the same model, not timed again."""
    monkeypatch.setenv("GENREC_SPEC_CACHE", str(tmp_path))
    model = on_codes(kit.tiny_llama(61, seed=0))
    timed = []
    original = QuantizedDraft.time_relative_cost

    def counting(self, batch_size, *args):
        timed.append(batch_size)
        return original(self, batch_size, *args)

    monkeypatch.setattr(QuantizedDraft, "time_relative_cost", counting)
    draft = QuantizedDraft(model)
    cost = draft.relative_cost(2)
    assert cost > 0 and draft.relative_cost(2) == cost and timed == [2]
    assert QuantizedDraft(model).relative_cost(2) == cost and timed == [2]  # from the file
    QuantizedDraft(model).relative_cost(1)
    assert timed == [2, 1] and len(list((tmp_path / "draft_cost").glob("*.json"))) == 2


def test_bad_input():
    """A target other than the native Llama it was built from, a chain of no tokens, codes or a
    GGUF file of another model, and a target not in fp32 (the draft writes its fp32 cache)."""
    from genrec_spec.models.llm.llama import Llama, LlamaConfig

    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = Llama(LlamaConfig(64, 32, 2, 4, 2, 64, max_seq_len=32)).eval()
    proposer = QuantizedSelfProposer(QuantizedDraft(model), k=2)
    target = CallableTarget(lambda ids: model(ids, model.new_cache(*ids.shape)))
    with pytest.raises(DecodeInputError, match="target's own KV cache"):
        generate(target, [[1, 2, 3]], proposer=proposer, max_new_tokens=4)
    with pytest.raises(DecodeInputError, match="k >= 1"):
        QuantizedSelfProposer(QuantizedDraft(model), k=0)
    wrong = {"layers.0.attention.wq.weight": quantize_q4(torch.zeros(64, 32))}
    with pytest.raises(ValueError, match="codes are of another model"):
        QuantizedDraft(model, wrong)
    with pytest.raises(ValueError, match="holds another model"):
        QuantizedDraft.from_gguf(model, smollm2_gguf_path())
    with pytest.raises(ValueError, match="load it in fp32"):
        QuantizedDraft(model.to(torch.bfloat16))


def test_draft_cost_follows_the_batch(kit, tmp_path, monkeypatch):
    """The controller's draft cost is the draft's measured ratio at the batch decoded, unless
    one is given."""
    monkeypatch.setenv("GENREC_SPEC_CACHE", str(tmp_path))
    model = on_codes(kit.tiny_llama(61, seed=0))
    draft = QuantizedDraft(model)
    adaptive, fixed = QuantizedSelfProposer(draft, k=3), QuantizedSelfProposer(draft, 3, 0.25)
    for batch in (1, 8):
        for proposer in (adaptive, fixed):
            generate(model, [[1, 2, 3]] * batch, proposer=proposer, max_new_tokens=2)
        assert adaptive.draft_cost == draft.relative_cost(batch) and fixed.draft_cost == 0.25


def test_layer_op_refuses_matrices_out_of_place(kit):
    """q4_decode_layers sizes its buffers by layer 0's matrices: a list in another order or
    short of a matrix is refused before anything is read."""
    model = kit.tiny_llama(61, seed=0)  # 2 layers: qkv [64, 32], gate_up [128, 32]
    draft = QuantizedDraft(model)
    cache = model.new_cache(1, 8)
    cos, sin = model._rope(torch.device("cpu"))

    def layers(weights):
        return torch.ops.genrec_spec.q4_decode_layers(
            model.tok_embeddings.weight[[1]], cos[[0]], sin[[0]], cache.k, cache.v,
            torch.tensor([0]), weights, draft.norms, 4, 2, 1e-5,
        )  # fmt: skip

    swapped = list(draft.weights)
    swapped[0:3], swapped[6:9] = swapped[6:9], swapped[0:3]  # layer 0's qkv <-> gate_up
    with pytest.raises(RuntimeError, match="do not fit a Llama"):
        layers(swapped)
    with pytest.raises(RuntimeError, match="12 weight tensors"):
        layers(draft.weights[:-3])
    assert layers(draft.weights).shape == (1, 32)
