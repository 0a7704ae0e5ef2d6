"""MTP modules: teacher forcing is the modules run position by position, training lowers every
depth's loss, the proposer's caches follow the accepted path and its chain is the modules',
lossless decoding (greedy equality, exact distribution) and the CLI."""

import pytest
import torch

from genrec_spec import ControllerConfig, SamplingParams, generate
from genrec_spec.llm.methods import make_proposer
from genrec_spec.llm.proposers import MTPProposer, MTPTreeProposer
from genrec_spec.llm.proposers.mtp import CHAIN_DEPTH
from genrec_spec.llm.training.checkpoint import DrafterError
from genrec_spec.llm.training.eagle import Sequences, token_loss
from genrec_spec.llm.training.mtp import MTPConfig, depth_losses, evaluate, load_mtp
from genrec_spec.models.llm.mtp_drafter import MTPDrafter

FIXED = ControllerConfig(adaptive=False)


def random_drafter(model, depths=3, seed=0):
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return MTPDrafter(
            model.config,
            model.tok_embeddings.weight,
            model.output.weight,
            depths,
        )


@pytest.fixture(scope="module")
def drafter(trained_mtp):
    return load_mtp(trained_mtp.folder, trained_mtp.model)[0]


def by_hand(drafter, features, tokens):  # [T, D], [T] -> per depth [T - k + 1, D]
    """Module k run one position at a time on its own cache, each position committed before
    the next, fed module k - 1's states and the true token x_{i+k} = tokens[i + k - 1]."""
    states, out, one = features, [], torch.ones(1, dtype=torch.long)
    for k in range(1, drafter.depths + 1):
        cache = drafter.new_cache(1, len(tokens))
        steps = []
        for i in range(len(tokens) - k + 1):
            h = drafter(k, states[i][None, None], tokens[i + k - 1][None, None], cache)
            cache.commit(torch.zeros(1, 1, dtype=torch.long), one)
            steps.append(h[0, 0])
        states = torch.stack(steps)
        out.append(states)
    return out


def test_teacher_forcing_is_the_modules_by_hand(trained_mtp):
    """Depth k's teacher-forced states over a batch of two uneven rows are module k run by
    hand on each row; depth k's loss is the token loss of those states against x_{i+k+1} at the
    continuation's positions."""
    t = trained_mtp
    drafter = random_drafter(t.model)
    sequences = Sequences(t.data, t.context)
    rows = [t.data.rows - 3, t.data.rows - 1]  # 46 and 44 pairs
    forced = drafter.teacher_forced(*sequences.batch(rows)[:2])
    for b, r in enumerate(rows):
        features, tokens, _ = sequences.row(r)
        hand = by_hand(drafter, features, tokens)
        for k, (states, mine) in enumerate(zip(forced, hand, strict=True), 1):
            torch.testing.assert_close(states[b, : len(tokens) - k + 1], mine, atol=1e-5, rtol=0)
    features, tokens, mask = sequences.batch(rows[-1:])  # hand: the last row's
    losses = depth_losses(drafter, features, tokens, mask)
    for k, (loss, states) in enumerate(zip(losses, hand, strict=True), 1):
        learnt = mask[0, k - 1 :]
        expected = token_loss(drafter, states[:-1][learnt], tokens[0, k:][learnt])
        torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-5)


def test_training_lowers_every_depth_and_round_trips(trained_mtp, drafter):
    """Every depth's loss falls well below fresh modules' on the training rows and top-1 rises;
    the manifest holds per-depth statistics; loading gives the saved weights."""
    t = trained_mtp
    sequences = Sequences(t.data, t.context, t.config.max_pairs)
    rows = list(range(0, t.data.rows, 3))
    before = evaluate(random_drafter(t.model, seed=t.config.seed), sequences, rows)
    after = evaluate(drafter, sequences, rows)
    for was, now in zip(before["depth_losses"], after["depth_losses"], strict=True):
        assert now < 0.6 * was
    assert after["top1"] > before["top1"] + 0.2
    assert after["chain"][0] >= after["chain"][1] >= after["chain"][2] > 0
    manifest = load_mtp(t.folder, t.model)[1]
    assert manifest == t.manifest and manifest["kind"] == "mtp"
    assert manifest["config"]["depths"] == 3 and manifest["target"]["hidden_layer"] == 2
    held = manifest["held_out"]
    assert len(held["chain"]) == 3 and len(held["depth_losses"]) == 3
    assert len(held["depth_ranks"]) == 3 and held["ranks"] == held["depth_ranks"][0]
    assert set(drafter.state_dict()) == {"vocab_ids"} | {n for n, _ in drafter.named_parameters()}


class Recording(MTPProposer):
    """Records, before each draft, the committed text and every module's frontier state, and
    the chain it drafts."""

    def begin(self, state):
        super().begin(state)
        self.seen = []

    def propose(self, state, budget):
        seen = (state.tokens.clone(), state.lengths.clone(), state.finished.clone())
        frontiers = [f.clone() for f in self.frontiers]
        tree = super().propose(state, budget)
        self.seen.append(seen + (frontiers, tree))
        return tree


def test_caches_follow_the_accepted_path(trained_mtp, drafter):
    """Before every draft of a chain, with rows keeping paths of different lengths: module k's
    frontier is its teacher-forced state at position L - 1 - k over the committed text (the
    target's features f_0 .. f_{L-2} from scratch), and the valid draft at depth d is module
    d's top token at position L - 2, teacher-forced on the text followed by the earlier
    drafts. A row drafts to depth L at most."""
    model, layer = trained_mtp.model, 2
    proposer = Recording(drafter, layer, depth=3)
    prompts = trained_mtp.greedy_prompts
    out = generate(model, prompts, max_new_tokens=30, proposer=proposer, controller=FIXED)
    assert out.stats.mean_accepted_length > 1.2
    checked = drafts = 0
    for tokens, lengths, finished, frontiers, tree in proposer.seen:
        for b in torch.nonzero(~finished).flatten().tolist():
            length = int(lengths[b])
            valid = tree.valid[b, 1:]
            assert valid.tolist() == [length >= max(2, d) for d in range(1, 4)]
            if length < 2:
                continue
            text = tokens[b : b + 1, :length]  # [1, L]
            _, hidden = model(text, model.new_cache(*text.shape), hidden_layers=(layer,))
            chain = torch.cat([text[:, 1:], tree.tokens[b : b + 1, 1:3]], dim=1)  # [1, L + 1]
            features = torch.cat([hidden[layer][:, :-1], torch.zeros(1, 2, 32)], dim=1)
            forced = drafter.teacher_forced(features, chain)
            for k in range(1, 4):
                if length - 1 - k >= 0:
                    state = forced[k - 1][0, length - 1 - k]
                    torch.testing.assert_close(frontiers[k - 1][b], state, atol=1e-4, rtol=1e-4)
                    checked += 1
                if valid[k - 1]:
                    top = drafter.vocab_ids[drafter.logits(forced[k - 1][0, length - 2]).argmax()]
                    assert int(top) == int(tree.tokens[b, k])
                    drafts += 1
    assert checked > 30 and drafts > 30


@pytest.mark.parametrize("kind", ["chain", "tree"])
def test_greedy_equals_plain(kit, trained_mtp, drafter, kind):
    """Batch 3 with uneven prompts (one of a single token) gives plain greedy decoding's
    tokens with the chain and with EAGLE-2's dynamic tree, at full depth and adaptive."""
    model = trained_mtp.model
    if kind == "chain":
        proposer = MTPProposer(drafter, 2, depth=3)
    else:
        proposer = MTPTreeProposer(drafter, 2, top_k=3, tree_nodes=12)
    kit.assert_greedy(model, proposer, FIXED, min_accepted=1.3)
    kit.assert_greedy(model, proposer, None)


def test_rejection_sampling_is_exact(kit):
    """Temperature 0.8: random modules' dynamic trees keep the target's exact distribution."""
    model = kit.exact_target()
    proposer = MTPTreeProposer(random_drafter(model, seed=3), 2, top_k=2, tree_nodes=8)
    kit.assert_exact(model, proposer, SamplingParams(0.8))


def test_tree_deeper_than_the_modules(trained_mtp, drafter):
    with pytest.raises(ValueError, match="has 3 modules"):
        MTPProposer(drafter, 2, choices=[(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)])
    with pytest.raises(ValueError, match="has 3 modules"):
        MTPTreeProposer(drafter, 2, depth=4)


def test_missing_or_other_drafter(trained_mtp, tmp_path):
    """Without an mtp drafter, generate names the command that trains one; an MTP folder is not
    taken for an EAGLE drafter."""
    model = trained_mtp.model
    missing = tmp_path / "nowhere"
    with pytest.raises(DrafterError, match="no trained mtp drafter") as err:
        make_proposer("mtp", model, drafter=missing)
    assert f"genrec-spec train-drafter --model smollm2 --kind mtp --out {missing}" in str(err.value)
    with pytest.raises(DrafterError, match="holds a mtp drafter"):
        make_proposer("eagle", model, drafter=trained_mtp.folder)


def test_cli_settings(kit, trained_mtp):
    """train-drafter --kind mtp takes --depths; generate --method mtp drafts the default
    chain."""
    config, command = kit.train_cli(["--kind", "mtp", "--steps", "7", "--depths", "2"])
    assert config == MTPConfig(steps=7, depths=2)
    assert "--kind mtp" in command and "--batch-rows 8 --depths 2 --draft-vocab 8192" in command
    proposer = make_proposer("mtp", trained_mtp.model, drafter=trained_mtp.folder)
    assert isinstance(proposer, MTPProposer) and proposer.k == CHAIN_DEPTH == 2
    assert proposer.hidden_layers == (2,)
