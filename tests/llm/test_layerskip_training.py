"""Exit-head training: layer-n states aligned with the self-distillation data, a head that
beats plain early exit on held-out rows, the checkpoint round trip and the manifest, the chain
statistics, and a clear error when no head was trained."""

import json

import pytest
import torch

from genrec_spec.llm.methods import make_proposer
from genrec_spec.llm.training.checkpoint import DrafterError
from genrec_spec.llm.training.layerskip import (
    LayerSkipConfig,
    evaluate,
    layer_states,
    load_layerskip,
)
from genrec_spec.models.llm.exit_head import ExitHead
from genrec_spec.models.llm.llama import LlamaConfig


def test_layer_states_align_with_the_data(distilled):
    """State j is hidden layer 1 at the position before tokens[j], as a full forward over the
    row's prompt + continuation gives it; rows batched by length keep their order."""
    model, data, prompts = distilled.model, distilled.data, distilled.prompts
    states = layer_states(model, prompts, data, 1, batch_size=4, progress=False)
    assert states.shape == data.hidden.shape
    for r in (0, 5, len(prompts) - 1):
        start, end = data.offsets[r], data.offsets[r + 1]
        seq = torch.tensor([prompts[r] + data.tokens[start:end].tolist()])
        _, hidden = model(seq, model.new_cache(*seq.shape), hidden_layers=(1,))
        first = len(prompts[r]) - 1
        expected = hidden[1][0, first : first + end - start]
        torch.testing.assert_close(states[start:end], expected, atol=1e-4, rtol=1e-4)


def test_chain_counts_runs_within_rows():
    """Chain depth k counts the starts whose next k tokens all agree, within their row."""
    config = LlamaConfig(vocab_size=4, dim=4, n_layers=2, n_heads=2, n_kv_heads=1, hidden_dim=8)
    lm_head = torch.eye(4)
    head = ExitHead(config, torch.ones(4), lm_head, 8)  # untrained: argmax of a one-hot state
    states = torch.eye(4)[[0, 1, 2, 3, 0, 1]]  # [S = 6, D]
    tokens = torch.tensor([0, 1, 3, 3, 0, 1])  # position 2 disagrees
    offsets = torch.tensor([0, 4, 6])  # agreeing runs: [0, 1] and [3] in row 0, [4, 5] in row 1
    out = evaluate(head, states, states, tokens, offsets, torch.arange(6), lm_head, 3)
    assert out["chain"] == pytest.approx([5 / 6, 2 / 4, 0 / 2]) and out["positions"] == 6


def test_training_beats_plain_early_exit_and_round_trips(trained_layerskip):
    model, manifest = trained_layerskip.model, trained_layerskip.manifest
    held = manifest["held_out"]
    assert held["top1"] > held["early_exit"]["top1"]
    assert held["acceptance"] > held["early_exit"]["acceptance"]
    assert len(held["chain"]) == 4 and held["chain"] == sorted(held["chain"], reverse=True)
    saved = json.loads((trained_layerskip.folder / "manifest.json").read_text())
    assert saved == manifest
    assert manifest["kind"] == "layerskip" and manifest["config"]["n_layers"] == 1
    assert manifest["target"]["hidden_layer"] == 1 and manifest["command"] == "test"
    assert manifest["data"]["key"] == trained_layerskip.data.key
    draft, _ = load_layerskip(trained_layerskip.folder, model)
    assert draft.n_layers == 1 and len(draft.head.vocab_ids) == 61
    assert not any(name == "draft_head" for name in draft.head.state_dict())
    ids = torch.tensor([[5, 9, 2], [4, 1, 1]])
    logits = draft(ids, model.new_cache(2, 3))  # [2, 3, 61]
    hidden = model.forward_layers(ids, model.new_cache(2, 3), n_layers=1)
    torch.testing.assert_close(logits, draft.head(hidden))
    assert make_proposer("layerskip", model, drafter=trained_layerskip.folder).k == 4


def test_missing_drafter_names_the_command(trained_layerskip, tmp_path):
    missing = tmp_path / "nowhere"
    command = f"genrec-spec train-drafter --model smollm2 --kind layerskip --out {missing}"
    with pytest.raises(DrafterError, match="no trained layerskip drafter") as err:
        make_proposer("layerskip", trained_layerskip.model, drafter=missing)
    assert command in str(err.value)


def test_train_cli_settings(kit):
    """--kind layerskip picks its config, --layers sets n, and the recorded command spells every
    setting out."""
    config, command = kit.train_cli(["--kind", "layerskip", "--layers", "8", "--steps", "9"])
    assert config == LayerSkipConfig(n_layers=8, steps=9)
    assert "--kind layerskip" in command and "--steps 9 --lr 0.002" in command
    assert "--layers 8 --batch-positions 256 --draft-vocab 8192" in command
