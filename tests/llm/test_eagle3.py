"""EAGLE-3: the fused low/mid/high features recomputed per row, the training-time test (each
step equals the drafter fed its own previous feature, as when drafting), training that lowers
every step's loss, lossless decoding (greedy equality, exact distribution) and the CLI."""

import pytest
import torch

from genrec_spec import ControllerConfig, SamplingParams
from genrec_spec.llm.methods import make_proposer
from genrec_spec.llm.proposers import Eagle2Proposer
from genrec_spec.llm.training.checkpoint import DrafterError
from genrec_spec.llm.training.eagle import load_eagle, token_loss
from genrec_spec.llm.training.eagle3 import (
    Eagle3Config,
    LayerSequences,
    evaluate,
    fused_layers,
    unrolled_losses,
)
from genrec_spec.models.llm.eagle_drafter import EagleDrafter

FIXED = ControllerConfig(adaptive=False)


@pytest.fixture(scope="module")
def sequences(trained_eagle3):
    t = trained_eagle3
    return LayerSequences(t.model, t.data, t.context, t.prompts, fused_layers(2), 384)


def random_drafter(model, seed=0):
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return EagleDrafter(model.config, model.tok_embeddings.weight, model.output.weight, fused=3)


def test_fused_layers():
    assert fused_layers(30) == (2, 15, 28) and fused_layers(2) == (0, 1, 2)


def test_layer_features_match_the_cached_final_layer(trained_eagle3, sequences):
    """The recomputed features are layers 0, 1, 2 side by side [T, 3 D]; the last third
    reproduces the cached final-layer states of the prompt and continuation pairs."""
    t = trained_eagle3
    for r in (0, t.data.rows - 3):
        features, tokens, start = sequences.row(r)
        prompt = slice(*t.context.offsets[r : r + 2].tolist())
        continuation = slice(*t.data.offsets[r : r + 2].tolist())
        cached = torch.cat([t.context.hidden[prompt], t.data.hidden[continuation]])
        assert features.shape == (len(tokens), 96) and start == prompt.stop - prompt.start
        torch.testing.assert_close(features[:, 64:], cached, atol=1e-4, rtol=1e-4)


def test_rows_keep_their_last_pairs(trained_eagle3, sequences):
    """A row longer than max_pairs loses prompt pairs from the front, never continuation."""
    t = trained_eagle3
    r = t.data.rows - 3  # 6 prompt pairs, then 40 continuation pairs
    short = LayerSequences(t.model, t.data, t.context, t.prompts, fused_layers(2), 42)
    features, tokens, start = sequences.row(r)
    cut_features, cut_tokens, cut_start = short.row(r)
    assert (len(tokens), start, len(cut_tokens), cut_start) == (46, 6, 42, 2)
    assert torch.equal(cut_tokens, tokens[4:]) and torch.equal(cut_features, features[4:])


def test_training_time_test_feeds_own_features(trained_eagle3, sequences):
    """Step 1 of the unrolled loss equals, start by start, a chain over the real pairs
    0 .. i followed by the pair (the drafter's own step-0 output at i, x_{i+2}): what a draft
    sees. Step 0 is EAGLE's plain next-token loss."""
    drafter = random_drafter(trained_eagle3.model)
    r = trained_eagle3.data.rows - 3
    features, tokens, mask = sequences.batch([r])
    step0, step1 = unrolled_losses(drafter, features, tokens, mask, 2)
    fused = drafter.fuse(features[0])  # [T, D]
    length = len(tokens[0])
    out0 = drafter(fused[None], tokens, drafter.new_cache(1, length))[0]  # [T, D]
    learnt = mask[0].nonzero().flatten()  # pair i learns pair i + 1
    torch.testing.assert_close(step0, token_loss(drafter, out0[learnt], tokens[0, learnt + 1]))
    own = []
    starts = mask[0, 1:].nonzero().flatten()  # step 1 from start i learns pair i + 2
    for i in starts.tolist():
        inputs = torch.cat([fused[: i + 1], out0[i : i + 1]])[None]  # [1, i + 2, D]
        out = drafter(inputs, tokens[:, : i + 2], drafter.new_cache(1, i + 2))
        own.append(out[0, -1])
    expected = token_loss(drafter, torch.stack(own), tokens[0, starts + 2])
    torch.testing.assert_close(step1, expected, atol=1e-5, rtol=1e-5)


def test_every_step_equals_its_own_chains_across_rows(trained_eagle3, sequences):
    """Rows of different prompt lengths, three steps: step j's loss equals, start by start and
    row by row, a chain over the real pairs 0 .. i followed by the drafter's own j outputs
    (each paired with its true next token), over every start whose draft is learnt. Steps
    j > 0 run from a subset of the starts (``unrolled_losses``): this checks none is lost."""
    drafter = random_drafter(trained_eagle3.model, seed=1)
    rows = [0, trained_eagle3.data.rows - 3, 1]
    features, tokens, mask = sequences.batch(rows)
    assert len({int(m.int().argmax()) for m in mask}) == len(rows)  # prompts differ
    losses = unrolled_losses(drafter, features, tokens, mask, 3)
    for j, loss in enumerate(losses):
        own, targets = [], []
        for r in range(len(rows)):
            fused = drafter.fuse(features[r])  # [T, D] (padding included: never learnt)
            for i in (mask[r, j:].nonzero().flatten()).tolist():  # start i learns x_{i+j+2}
                inputs, ids = fused[: i + 1], tokens[r, : i + 1]
                out = drafter(inputs[None], ids[None], drafter.new_cache(1, i + 1))[0, -1]
                for step in range(1, j + 1):  # own feature, true token, one node deeper
                    inputs = torch.cat([inputs, out[None]])
                    ids = tokens[r, : i + step + 1]
                    chain = drafter(inputs[None], ids[None], drafter.new_cache(1, len(ids)))
                    out = chain[0, -1]
                own.append(out)
                targets.append(tokens[r, i + j + 1])
        expected = token_loss(drafter, torch.stack(own), torch.stack(targets))
        torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-5)


def test_training_lowers_every_step_and_round_trips(trained_eagle3, sequences):
    """Every training-time-test step's loss falls well below a fresh drafter's on the
    training rows, and top-1 rises; the manifest names the fused layers; loading gives the
    same weights."""
    t = trained_eagle3
    rows = list(range(0, t.data.rows, 3))
    fresh = random_drafter(t.model, t.config.seed)
    before = evaluate(fresh, sequences, rows, 2, 3)
    drafter, manifest = load_eagle(t.folder, t.model, kind="eagle3")
    after = evaluate(drafter, sequences, rows, 2, 3)
    assert len(after["step_losses"]) == 3
    for was, now in zip(before["step_losses"], after["step_losses"], strict=True):
        assert now < 0.6 * was
    assert after["top1"] > before["top1"] + 0.2
    assert manifest == t.manifest and manifest["kind"] == "eagle3"
    assert manifest["target"]["hidden_layer"] == [0, 1, 2] and manifest["config"]["unroll"] == 3
    held = manifest["held_out"]
    assert len(held["chain"]) == 4 and len(held["step_losses"]) == 3
    assert set(drafter.state_dict()) == {"vocab_ids"} | {n for n, _ in drafter.named_parameters()}
    assert drafter.fuse[0].weight.shape == (32, 96)


@pytest.mark.parametrize("controller", [FIXED, None], ids=["full-depth", "adaptive"])
def test_greedy_equals_plain(trained_eagle3, controller, kit):
    """generate --method eagle3: EAGLE-2's dynamic tree on the fused features; batch 3 with
    uneven prompts (one of a single token) gives plain greedy decoding's tokens."""
    model = trained_eagle3.model
    proposer = make_proposer("eagle3", model, drafter=trained_eagle3.folder)
    assert isinstance(proposer, Eagle2Proposer) and proposer.hidden_layers == (0, 1, 2)
    kit.assert_greedy(model, proposer, controller)


def test_rejection_sampling_is_exact(kit):
    """Temperature 0.8: a random fused drafter's dynamic trees keep the target's exact
    distribution."""
    model = kit.exact_target()
    proposer = Eagle2Proposer(random_drafter(model, 3), (0, 1, 2), depth=3, top_k=2, tree_nodes=8)
    kit.assert_exact(model, proposer, SamplingParams(0.8))


def test_missing_or_other_drafter(trained_eagle, tmp_path):
    """Without an eagle3 drafter, generate names the command that trains one; an EAGLE-1
    folder is not taken for one."""
    model = trained_eagle.model
    missing = tmp_path / "nowhere"
    with pytest.raises(DrafterError, match="no trained eagle3 drafter") as err:
        make_proposer("eagle3", model, drafter=missing)
    assert f"genrec-spec train-drafter --model smollm2 --kind eagle3 --out {missing}" in str(
        err.value
    )
    with pytest.raises(DrafterError, match="holds a eagle drafter"):
        make_proposer("eagle3", model, drafter=trained_eagle.folder)


def test_train_cli_settings(kit):
    config, command = kit.train_cli(["--kind", "eagle3", "--steps", "7", "--unroll", "2"])
    assert config == Eagle3Config(steps=7, unroll=2)
    assert "--kind eagle3" in command
    assert "--batch-rows 8 --unroll 2 --draft-vocab 8192" in command
