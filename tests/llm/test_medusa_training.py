"""The shared training pipeline and Medusa training: self-distillation data (layout, cache),
head labels, training that lowers the loss, the checkpoint round trip, and clear errors for a
missing drafter folder or one made for another target."""

import json

import pytest
import torch

from genrec_spec.llm.methods import make_proposer
from genrec_spec.llm.training.checkpoint import DrafterError, load_drafter
from genrec_spec.llm.training.medusa import IGNORE, evaluate, head_labels, load_medusa
from genrec_spec.llm.training.selfdistill import distill, load_or_distill
from genrec_spec.models.llm.medusa_heads import MedusaHeads


def test_selfdistill_layout(kit):
    """Row r holds the continuation of prompt r (cut after eos); hidden[j] is the state whose
    LM-head argmax is tokens[j], and it matches a from-scratch forward of prompt + tokens."""
    model = kit.tiny_llama(61, seed=0, scale=1.0)
    prompts = [[5, 9, 2, 33, 7], [4], [12, 3, 40]]
    hidden, tokens, offsets = distill(model, prompts, 12, batch_size=2, progress=False)
    assert offsets.tolist() == [0, 12, 24, 36] and hidden.shape == (36, 32)
    head = torch.nn.functional.linear(hidden, model.output.weight)
    assert (head.argmax(-1) == tokens).all()
    eos = int(tokens[3])  # row 0 stops at its 4th token
    _, cut, cut_offsets = distill(
        model, prompts, 12, batch_size=3, eos_token_id=eos, progress=False
    )
    assert cut[:4].tolist() == tokens[:4].tolist() and int(cut_offsets[1]) == 4
    seq = torch.tensor([prompts[2] + tokens[24:36].tolist()])
    _, full = model(seq, model.new_cache(*seq.shape), hidden_layers=(2,))
    torch.testing.assert_close(hidden[24:36], full[2][0, 2:14], atol=1e-4, rtol=1e-4)


def test_selfdistill_cache(kit, tmp_path, monkeypatch):
    """Cached once under drafters/selfdistill/<key>.safetensors (no temporary file left), read
    back without generating, and keyed by the settings."""
    model = kit.tiny_llama(61, seed=0, scale=1.0)
    prompts = [[5, 9, 2], [4, 1]]
    first = load_or_distill(model, prompts, 6, 2, cache_dir=tmp_path, progress=False)
    files = list((tmp_path / "drafters" / "selfdistill").iterdir())
    assert [f.name for f in files] == [f"{first.key}.safetensors"]
    monkeypatch.setattr("genrec_spec.llm.training.selfdistill.distill", pytest.fail)
    again = load_or_distill(model, prompts, 6, 2, cache_dir=tmp_path, progress=False)
    assert torch.equal(again.hidden, first.hidden) and again.key == first.key
    monkeypatch.undo()
    longer = load_or_distill(model, prompts, 7, 2, cache_dir=tmp_path, progress=False)
    assert longer.key != first.key and len(longer.tokens) == 14


def test_head_labels_stay_in_their_row():
    tokens = torch.tensor([10, 11, 12, 20, 21])
    labels = head_labels(tokens, torch.tensor([0, 3, 5]), num_heads=2)
    x = IGNORE
    assert labels.tolist() == [[11, 12], [12, x], [x, x], [21, x], [x, x]]


def test_training_lowers_loss_and_round_trips(trained):
    """The trained heads beat their initialisation (the target's LM head itself) on the training
    positions; the folder holds weights + manifest, and loading gives the same heads."""
    model, data, config = trained.model, trained.data, trained.config
    labels = head_labels(data.tokens, data.offsets, config.num_heads)
    before = evaluate(MedusaHeads(model.output.weight, config.num_heads), data.hidden, labels)
    heads, manifest = load_medusa(trained.folder, model)
    after = evaluate(heads, data.hidden, labels)
    assert after["loss"] < before["loss"] - 0.2
    assert sum(after["top1"]) > sum(before["top1"])
    assert sorted(p.name for p in trained.folder.iterdir()) == [
        "manifest.json",
        "weights.safetensors",
    ]
    saved = json.loads((trained.folder / "manifest.json").read_text())
    assert saved == manifest == trained.manifest
    assert manifest["kind"] == "medusa" and manifest["steps"] == 150
    assert manifest["target"]["hidden_layer"] == model.config.n_layers
    assert manifest["data"]["key"] == data.key and manifest["command"] == "test"
    assert len(manifest["held_out"]["top1"]) == len(manifest["held_out"]["chain"]) == 3
    x = data.hidden[:5, None]
    fresh = MedusaHeads(model.output.weight, config.num_heads)
    fresh.load_state_dict(heads.state_dict())
    torch.testing.assert_close(heads(x), fresh(x), rtol=0, atol=0)
    assert heads.num_heads == 3 and not any(k == "lm_head" for k in heads.state_dict())


def test_missing_drafter_names_the_command(trained, tmp_path):
    missing = tmp_path / "nowhere"
    command = f"genrec-spec train-drafter --model smollm2 --kind medusa --out {missing}"
    with pytest.raises(DrafterError, match="no trained medusa drafter") as err:
        make_proposer("medusa", trained.model, drafter=missing)
    assert command in str(err.value)


def test_drafter_for_another_target(kit, trained):
    wider = kit.tiny_llama(61, seed=0, dim=48, scale=1.0)
    with pytest.raises(DrafterError, match="dim 32, vocab_size 61.*this target has dim 48"):
        load_medusa(trained.folder, wider)
    same_shape = kit.tiny_llama(61, seed=7, scale=1.0)
    with pytest.raises(DrafterError, match="other weights of the same shape"):
        load_medusa(trained.folder, same_shape)
    with pytest.raises(DrafterError, match="holds a medusa drafter"):
        load_drafter(trained.folder, "eagle", trained.model)
    proposer = make_proposer("medusa", trained.model, drafter=trained.folder)
    assert proposer.k == 3 and proposer.hidden_layers == (trained.model.config.n_layers,)
