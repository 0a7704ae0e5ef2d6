"""The distilled draft model: its training forward matches the decoding forward, training lowers
the KL to the target and raises agreement, the checkpoint holds only the trained layers and
binds to its target, the loaded draft shares the target's embeddings and converts to an equal
transformers model; decoding with it (`generate --method distilled`) is lossless: greedy equals
plain greedy at batch 3 with uneven prompts, rejection sampling reproduces the target's exact
distribution; clear errors for a missing folder or another target."""

import json
from types import SimpleNamespace

import pytest
import torch

from genrec_spec import ControllerConfig, SamplingParams, generate
from genrec_spec.llm.methods import make_proposer
from genrec_spec.llm.proposers import DraftModelProposer
from genrec_spec.llm.training.checkpoint import DrafterError
from genrec_spec.llm.training.distill import (
    DistillConfig,
    Texts,
    evaluate,
    hidden_states,
    initial_draft,
    load_distilled,
    relative_cost,
    train_distilled,
)
from genrec_spec.llm.training.selfdistill import load_or_distill, load_or_prefill
from genrec_spec.models.llm.llama_loading import to_hf

FIXED = ControllerConfig(adaptive=False)


@pytest.fixture(scope="module")
def trained_draft(distilled, tmp_path_factory) -> SimpleNamespace:
    """A one-layer draft (from the tiny target's layer 0) trained briefly on the tiny target's
    own continuations and the prompts' pairs, saved to a folder."""
    model, prompts = distilled.model, distilled.prompts
    context = load_or_prefill(model, prompts, 9, cache_dir=distilled.cache)
    folder = tmp_path_factory.mktemp("drafter") / "draft"
    config = DistillConfig(layers=(0,), steps=150, batch_rows=4, lr=3e-3, held_out=0.2)
    manifest = train_distilled(
        model, distilled.data, context, prompts, config, folder, {"command": "test"}, False
    )
    texts = Texts(distilled.data, context, prompts)
    return SimpleNamespace(
        **vars(distilled), texts=texts, folder=folder, manifest=manifest, config=config
    )


def test_training_forward_matches_decoding(kit):
    """hidden_states (with autograd) gives the final-normed states the inference forward gives,
    at batch 2 with the shorter row padded after its text."""
    model = kit.tiny_llama(61, seed=0)
    draft = initial_draft(model, (1,))
    ids = torch.tensor([[5, 9, 2, 33, 7, 1], [4, 8, 0, 0, 0, 0]])  # row 2: 2 tokens, padding
    trained = hidden_states(draft, ids)
    assert trained.requires_grad
    _, hidden = draft(ids, draft.new_cache(*ids.shape), hidden_layers=(1,))
    torch.testing.assert_close(trained[0], hidden[1][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(trained[1, :2], hidden[1][1, :2], rtol=1e-5, atol=1e-5)
    full = initial_draft(model, (0, 1))  # every layer: the target itself
    torch.testing.assert_close(
        full(ids, full.new_cache(*ids.shape)), model(ids, model.new_cache(*ids.shape))
    )
    with pytest.raises(DrafterError, match="non-empty list of target layers"):
        initial_draft(model, (0, 2))


def test_training_lowers_kl_and_round_trips(trained_draft):
    """The trained draft beats its initialisation on the training rows (KL, top-1); the
    checkpoint holds its layer and final norm only; the loaded draft shares the target's
    embeddings and LM head, and its transformers copy computes the same logits."""
    model, texts = trained_draft.model, trained_draft.texts
    rows = list(range(0, trained_draft.data.rows, 3))
    before = evaluate(initial_draft(model, (0,)), texts, rows, 3)
    draft, manifest = load_distilled(trained_draft.folder, model)
    after = evaluate(draft, texts, rows, 3)
    assert after["kl"] < 0.2 * before["kl"] and after["top1"] > before["top1"] + 0.1
    saved = json.loads((trained_draft.folder / "manifest.json").read_text())
    assert saved == manifest == trained_draft.manifest
    assert manifest["kind"] == "draft" and manifest["steps"] == 150
    assert manifest["config"]["layers"] == [0] and manifest["command"] == "test"
    assert manifest["relative_cost"] == pytest.approx(relative_cost(draft, model))
    assert 0.5 < manifest["relative_cost"] < 1  # 1 of 2 layers, and the whole LM head
    held = manifest["held_out"]
    assert held["top1"] == held["chain"][0] and held["chain"][-1] <= held["chain"][0]
    assert 0 < held["sampling_acceptance"] <= 1 and held["positions"] > 0
    weights = sorted(p.name for p in trained_draft.folder.iterdir())
    assert weights == ["manifest.json", "weights.safetensors"]
    assert draft.config.n_layers == 1
    assert draft.tok_embeddings.weight.data_ptr() == model.tok_embeddings.weight.data_ptr()
    assert draft.output.weight.data_ptr() == model.output.weight.data_ptr()
    ids = torch.tensor([[5, 9, 2, 33, 7], [4, 1, 1, 2, 3]])
    hf = to_hf(draft)
    assert hf.lm_head.weight.data_ptr() == model.output.weight.data_ptr()
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, draft(ids, draft.new_cache(*ids.shape)))


def test_greedy_equals_plain(trained_draft):
    """generate --method distilled's proposer: B = 3, uneven prompts (one of one token)."""
    model = trained_draft.model
    prompts = [[5, 9, 2, 33, 7, 1, 8], [4], [12, 3, 3, 40, 22]]  # among the training prompts
    plain = generate(model, prompts, max_new_tokens=30).tolist()
    for controller in (FIXED, None):
        proposer = make_proposer("distilled", model, k=4, drafter=trained_draft.folder)
        assert isinstance(proposer, DraftModelProposer) and proposer.k == 4
        out = generate(model, prompts, max_new_tokens=30, proposer=proposer, controller=controller)
        assert out.tolist() == plain
    assert out.stats.mean_accepted_length > 1.5  # drafts were accepted: the check has teeth


def test_rejection_sampling_is_exact(kit, tmp_path):
    """Temperature 0.8 on a vocabulary of 8: a draft trained briefly and loaded back drafts
    3-deep chains (accepted at every depth); the histogram of the first 3 generated tokens over
    6000 rows per prompt matches the enumerated target distribution (512 sequences)."""
    model = kit.exact_target()
    prompts = [[1, 2, 3], [5, 4, 4, 1], [6], [7, 0, 2], [3, 3]]
    data = load_or_distill(model, prompts, 12, 5, cache_dir=tmp_path, progress=False)
    context = load_or_prefill(model, prompts, 5, cache_dir=tmp_path)
    config = DistillConfig(layers=(1,), steps=10, batch_rows=2, held_out=0.2)
    train_distilled(model, data, context, prompts, config, tmp_path / "draft", progress=False)
    proposer = make_proposer("distilled", model, k=kit.EXACT_LENGTH, drafter=tmp_path / "draft")
    sampling = SamplingParams(0.8)
    kit.assert_exact(model, proposer, sampling)


def test_missing_draft_and_other_target(trained_draft, kit, tmp_path):
    """A missing folder names the command that trains the draft; a draft refuses a target with
    other weights of the same shape."""
    missing = tmp_path / "nowhere"
    command = f"genrec-spec train-drafter --model smollm2 --kind draft --out {missing}"
    with pytest.raises(DrafterError, match="no trained draft drafter") as err:
        make_proposer("distilled", trained_draft.model, drafter=missing)
    assert command in str(err.value)
    other = kit.tiny_llama(61, seed=1, scale=1.0)
    with pytest.raises(DrafterError, match="other weights of the same shape"):
        load_distilled(trained_draft.folder, other)


def test_train_cli_settings(kit):
    """--kind draft and --kind distilled train the same draft; flags override the defaults and
    the recorded command spells every setting out."""
    argv = ["--kind", "distilled", "--init-layers", "0,5", "--batch-rows", "2"]
    config, command = kit.train_cli(argv)
    assert config == DistillConfig(layers=(0, 5), batch_rows=2)
    assert "--kind distilled" in command and "--batch-rows 2 --init-layers 0,5" in command
    assert kit.train_cli(["--kind", "draft"])[0] == DistillConfig()
