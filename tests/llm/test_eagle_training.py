"""EAGLE training: the prompts' teacher-forced pairs (layout, cache), sequences and their loss
positions, the draft vocabulary, training that lowers the loss, the checkpoint round trip, and
clear errors for a missing drafter folder (for eagle and eagle2, which share the drafter)."""

import json

import pytest
import torch

from genrec_spec.core.types import DecodeInputError
from genrec_spec.llm.methods import make_proposer
from genrec_spec.llm.proposers import Eagle2Proposer, EagleProposer
from genrec_spec.llm.training.checkpoint import DrafterError
from genrec_spec.llm.training.eagle import (
    EagleConfig,
    Sequences,
    draft_vocabulary,
    evaluate,
    load_eagle,
)
from genrec_spec.llm.training.medusa import MedusaConfig
from genrec_spec.llm.training.pipeline import prompts_of
from genrec_spec.llm.training.selfdistill import load_or_prefill
from genrec_spec.models.llm.eagle_drafter import EagleDrafter


def test_prompt_pairs_layout(trained_eagle):
    """Row r holds prompt r's pairs: the target's state at positions 0 .. L-2 with the prompt
    token after each, matching a from-scratch forward; a one-token prompt has none. Cached as
    prompts-<key>.safetensors and read back."""
    model, context, prompts = trained_eagle.model, trained_eagle.context, trained_eagle.prompts
    sizes = context.offsets.diff().tolist()
    assert sizes == [len(p) - 1 for p in prompts] and context.rows == trained_eagle.data.rows
    # The longest prompt and the shortest with a pair (batched by length, then put back).
    longest = max(range(len(prompts)), key=lambda i: len(prompts[i]))
    shortest = min(
        (i for i in range(len(prompts)) if len(prompts[i]) > 1), key=lambda i: len(prompts[i])
    )
    for r in (longest, shortest):
        rows = slice(*context.offsets[r : r + 2].tolist())
        assert context.tokens[rows].tolist() == prompts[r][1:]
        seq = torch.tensor([prompts[r]])
        _, hidden = model(seq, model.new_cache(*seq.shape), hidden_layers=(2,))
        torch.testing.assert_close(context.hidden[rows], hidden[2][0, :-1], atol=1e-4, rtol=1e-4)
    folder = trained_eagle.cache / "drafters" / "selfdistill"
    assert (folder / f"prompts-{context.key}.safetensors").is_file()
    again = load_or_prefill(model, prompts, 9, cache_dir=trained_eagle.cache)
    assert again.key == context.key and torch.equal(again.hidden, context.hidden)


def test_sequences_learn_continuation_pairs_only(trained_eagle):
    """A row's sequence is its prompt pairs then its continuation pairs; pair i learns pair i+1
    only where i+1 is a continuation pair (the prompt is context)."""
    sequences = Sequences(trained_eagle.data, trained_eagle.context)
    lengths = [7, 1]  # GREEDY_PROMPTS[0] and [1]: 6 and 0 prompt pairs, then 40 generated
    rows = [len(trained_eagle.prompts) - 3, len(trained_eagle.prompts) - 2]
    features, tokens, mask = sequences.batch(rows)
    assert features.shape == (2, 46, 32) and tokens.shape == (2, 46)
    assert mask[0].nonzero().flatten().tolist() == list(range(lengths[0] - 2, 45))
    assert mask[1].nonzero().flatten().tolist() == list(range(0, 39))  # 40 pairs, then padding
    assert tokens[0, :6].tolist() == trained_eagle.prompts[rows[0]][1:]


def test_draft_vocabulary():
    tokens = torch.tensor([5, 5, 5, 2, 2, 9, 9, 7])
    assert draft_vocabulary(tokens, 10, 3).tolist() == [2, 5, 9]  # 7 loses the tie to 2 and 9
    assert draft_vocabulary(tokens, 10, 6).tolist() == [0, 1, 2, 5, 7, 9]  # then lowest ids
    assert draft_vocabulary(tokens, 10, 0) is None and draft_vocabulary(tokens, 10, 10) is None


def test_training_lowers_loss_and_round_trips(trained_eagle):
    """The trained drafter beats its initialisation on the training rows and in top-1; the
    folder holds weights + manifest; loading gives the same drafter, without the target's
    embedding or LM head in the checkpoint."""
    model, config = trained_eagle.model, trained_eagle.config
    sequences = Sequences(trained_eagle.data, trained_eagle.context)
    rows = list(range(0, trained_eagle.data.rows, 3))
    with torch.random.fork_rng():
        torch.manual_seed(config.seed)
        fresh = EagleDrafter(model.config, model.tok_embeddings.weight, model.output.weight)
    before = evaluate(fresh, sequences, rows, 2, config.ce_weight)
    drafter, manifest = load_eagle(trained_eagle.folder, model)
    after = evaluate(drafter, sequences, rows, 2, config.ce_weight)
    assert after["loss"] < 0.5 * before["loss"] and after["top1"] > before["top1"] + 0.2
    assert sorted(p.name for p in trained_eagle.folder.iterdir()) == [
        "manifest.json",
        "weights.safetensors",
    ]
    saved = json.loads((trained_eagle.folder / "manifest.json").read_text())
    assert saved == manifest == trained_eagle.manifest
    assert manifest["kind"] == "eagle" and manifest["steps"] == 150
    assert manifest["target"]["hidden_layer"] == model.config.n_layers
    assert manifest["data"]["key"] == trained_eagle.data.key and manifest["command"] == "test"
    assert manifest["context"]["key"] == trained_eagle.context.key
    assert manifest["draft_vocab"] == 61  # the default 8192 exceeds the tiny vocabulary
    held = manifest["held_out"]
    assert len(held["chain"]) == 4 and held["chain"][-1] < held["chain"][0]
    assert held["top1"] == held["chain"][0] == held["ranks"][0] and held["vocab_coverage"] == 1
    assert set(drafter.state_dict()) == {"vocab_ids"} | {
        name for name, _ in drafter.named_parameters()
    }
    features, tokens, _ = sequences.batch(rows[:2])
    copy = EagleDrafter(model.config, model.tok_embeddings.weight, model.output.weight)
    copy.load_state_dict(drafter.state_dict())
    torch.testing.assert_close(
        drafter(features, tokens, drafter.new_cache(*tokens.shape)),
        copy(features, tokens, copy.new_cache(*tokens.shape)),
        rtol=0,
        atol=0,
    )


def test_make_proposer_and_missing_drafter(trained_eagle, tmp_path):
    """eagle and eagle2 load the same eagle drafter; the static tree follows its held-out rank
    statistics; a missing folder names the command that trains it (--kind eagle for both)."""
    model = trained_eagle.model
    static = make_proposer("eagle", model, drafter=trained_eagle.folder)
    dynamic = make_proposer("eagle2", model, drafter=trained_eagle.folder)
    assert isinstance(static, EagleProposer) and isinstance(dynamic, Eagle2Proposer)
    assert static.hidden_layers == dynamic.hidden_layers == (model.config.n_layers,)
    assert static.k > 1 and dynamic.k == 6
    # EAGLE-2's tree, as bench llm --tree-nodes / --tree-top-k / --tree-depth set it
    wide = make_proposer(
        "eagle2", model, drafter=trained_eagle.folder, tree_nodes=30, tree_top_k=6, tree_depth=8
    )
    assert (wide.tree_nodes, wide.top_k, wide.k) == (30, 6, 8)
    assert (dynamic.tree_nodes, dynamic.top_k) == (12, 4)
    with pytest.raises(DecodeInputError, match="tree_nodes=0"):
        make_proposer("eagle2", model, drafter=trained_eagle.folder, tree_nodes=0)
    missing = tmp_path / "nowhere"
    command = f"genrec-spec train-drafter --model smollm2 --kind eagle --out {missing}"
    for method in ("eagle", "eagle2"):
        with pytest.raises(DrafterError, match="no trained eagle drafter") as err:
            make_proposer(method, model, drafter=missing)
        assert command in str(err.value)


def test_drafter_of_another_kind(trained, trained_eagle):
    with pytest.raises(DrafterError, match="holds a medusa drafter"):
        load_eagle(trained.folder, trained_eagle.model)
    with pytest.raises(DrafterError, match="holds a eagle drafter"):
        make_proposer("medusa", trained_eagle.model, drafter=trained_eagle.folder)


def test_train_cli_settings(kit):
    """--kind picks the config (eagle2 trains the eagle drafter), flags override defaults, and
    the recorded command spells every setting out."""
    config, command = kit.train_cli(["--kind", "eagle2", "--steps", "7", "--draft-vocab", "0"])
    assert config == EagleConfig(steps=7, draft_vocab=0)
    assert "--kind eagle2" in command and "--steps 7 --lr 0.001" in command
    assert "--batch-rows 8 --draft-vocab 0" in command
    assert "--prompts humaneval:123,pystdlib:600 " in command  # EAGLE's default corpora
    assert kit.train_cli(["--kind", "medusa"])[0] == MedusaConfig()
    # EAGLE-3 shares EAGLE's corpora, the other kinds default to HumanEval alone; --prompts
    # overrides any default
    assert prompts_of(kit.train_job(["--kind", "eagle3"])) == "humaneval:123,pystdlib:600"
    for kind in ("medusa", "mtp", "draft", "distilled", "layerskip"):
        assert prompts_of(kit.train_job(["--kind", kind])) == "humaneval:123"
    given = kit.train_job(["--kind", "eagle", "--prompts", "pystdlib:5"])
    assert prompts_of(given) == "pystdlib:5"
    # settings that cannot train: refused before the target loads (0 steps divided by zero;
    # -1 threads raised in torch; 0 prompts, rows or heads trained on nothing)
    for argv, says in (
        (["--steps", "0"], "--steps 0 must be >= 1"),
        (["--n", "-1", "--batch-size", "0"], "--n -1, --batch-size 0 must be >= 1"),
        (["--threads", "-1"], "--threads -1 must be >= 1"),
        (["--draft-vocab", "-1"], "--draft-vocab -1 must be >= 0"),
        (["--lr", "nan"], "--lr nan"),
        (["--lr", "0"], "--lr 0.0"),
        (["--out", __file__], "is a file"),
    ):
        with pytest.raises(DrafterError, match=says):
            kit.train_job(["--kind", "medusa", *argv])
