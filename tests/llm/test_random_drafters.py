"""Drawn at random: a tiny native Llama (vocabulary, depth, KV heads), a drafter of each trained
kind with random weights (Medusa, EAGLE-1, EAGLE-2, EAGLE-3, MTP chains and trees, layer skip;
a draft vocabulary in some draws), the batch, prompts (single tokens among them), the length, an
end token and a catalogue: greedy decoding with the drafter is plain greedy decoding. The seeds
kept are 14 of the first 700 draws (all equal; docs/results/beam.md), chosen so every kind has
drafts accepted at depth 2 and catalogues, end tokens and draft vocabularies all occur."""

import random
from types import SimpleNamespace

import pytest
import torch

from genrec_spec import ControllerConfig, generate
from genrec_spec.core.constraints import Catalogue
from genrec_spec.llm.proposers import (
    Eagle2Proposer,
    EagleProposer,
    LayerSkipProposer,
    MedusaProposer,
    MTPProposer,
    MTPTreeProposer,
)
from genrec_spec.models.llm.eagle_drafter import EagleDrafter
from genrec_spec.models.llm.exit_head import EarlyExit, ExitHead
from genrec_spec.models.llm.llama import Llama, LlamaConfig
from genrec_spec.models.llm.medusa_heads import MedusaHeads
from genrec_spec.models.llm.mtp_drafter import MTPDrafter

KINDS = ["medusa", "eagle", "eagle2", "eagle3", "mtp", "mtp-tree", "layerskip"]  # seed % 7


def random_llama(r: random.Random, seed: int) -> Llama:
    dim = r.choice([32, 48])
    config = LlamaConfig(
        vocab_size=r.choice([20, 40, 61, 97]),
        dim=dim,
        n_layers=r.choice([2, 3, 4]),
        n_heads=4,
        n_kv_heads=r.choice([1, 2, 4]),
        hidden_dim=2 * dim,
        rope_theta=500.0,
        max_seq_len=160,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Llama(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(r.choice([1.5, 2.5, 4.0]))  # peaked: few near-ties between greedy tokens
    return model


def random_proposer(r: random.Random, model: Llama, kind: str, seed: int):
    config, layers = model.config, model.config.n_layers
    embedding, head = model.tok_embeddings.weight, model.output.weight
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        ids = None  # a draft vocabulary: a random subset of the target's
        if r.random() < 0.25:
            ids = torch.tensor(sorted(r.sample(range(config.vocab_size), r.randint(2, 20))))
        vocab = config.vocab_size if ids is None else len(ids)
        if kind == "medusa":
            heads = MedusaHeads(head, num_heads=r.randint(1, 4))
            with torch.no_grad():
                heads.weight.normal_(0, r.choice([0.0, 0.05, 0.3]))
            return MedusaProposer(heads, layers, tree_nodes=r.randint(1, 30))
        if kind == "eagle":  # (a static tree may ask more children than a draft vocabulary has)
            drafter = EagleDrafter(config, embedding, head)
            return EagleProposer(
                drafter, layers, tree_nodes=r.randint(1, 20), max_depth=r.randint(1, 6)
            )
        if kind in ("eagle2", "eagle3"):
            fused = 3 if kind == "eagle3" else 1
            drafter = EagleDrafter(config, embedding, head, ids, fused=fused)
            layer = tuple(sorted(r.sample(range(layers + 1), 3))) if fused == 3 else layers
            return Eagle2Proposer(
                drafter,
                layer,
                depth=r.randint(1, 6),
                top_k=r.randint(1, min(5, vocab)),
                tree_nodes=r.randint(1, 20),
            )
        if kind in ("mtp", "mtp-tree"):
            drafter = MTPDrafter(config, embedding, head, depths=r.randint(1, 4), vocab_ids=ids)
            if kind == "mtp":
                return MTPProposer(drafter, layers, depth=r.randint(1, drafter.depths))
            return MTPTreeProposer(
                drafter, layers, top_k=r.randint(1, min(4, vocab)), tree_nodes=r.randint(1, 12)
            )
        exit_head = ExitHead(config, model.norm.weight, head, hidden_dim=config.dim)
        early = EarlyExit(model, exit_head, r.randint(1, layers - 1))
        return LayerSkipProposer(early, k=r.randint(1, 5))


def draw(seed: int) -> SimpleNamespace:
    """One random setting: the model, the drafter and generate's arguments."""
    r = random.Random(seed)
    model = random_llama(r, seed)
    vocab, kind = model.config.vocab_size, KINDS[seed % len(KINDS)]
    proposer = random_proposer(r, model, kind, seed)
    prompts = [[r.randrange(vocab) for _ in range(r.randint(1, 9))] for _ in range(r.randint(1, 4))]
    eos = r.choice([None, r.randrange(vocab)])
    constraint = None
    if r.random() < 0.3:  # a catalogue; without an end token, items of one length
        length = r.randint(1, 5)
        items = {
            tuple(r.randrange(vocab) for _ in range(r.randint(1, 5) if eos is not None else length))
            for _ in range(r.randint(1, 30))
        }
        items = [list(item) for item in items if eos not in item]
        if items:
            constraint = Catalogue.of(items, vocab, eos_token_id=eos)
    controller = r.choice([None, ControllerConfig(adaptive=False)])
    max_new = r.randint(1, 30)
    if constraint is not None:  # an item must fit; without an end token, exactly
        max_new = length if eos is None else max(max_new, constraint.trie.longest)
    return SimpleNamespace(
        model=model,
        kind=kind,
        proposer=proposer,
        prompts=prompts,
        controller=controller,
        kwargs=dict(max_new_tokens=max_new, eos_token_id=eos, constraint=constraint),
    )


# Two draws a kind, each with drafts accepted at depth 2: catalogues in 434, 330 and 589, an
# end token in 105, 330, 688, 416, 39, 46, 145 and 62, draft vocabularies in 688, 411 and 145,
# single-token prompts in 105, 330, 416, 39, 411 and 62, the adaptive controller in 105, 589
SEEDS = [434, 105, 330, 589, 373, 688, 416, 59, 39, 46, 411, 145, 62, 55]


@pytest.mark.parametrize("seed", SEEDS)
def test_random_drafters_decode_greedy_exactly(seed):
    d = draw(seed)
    plain = generate(d.model, d.prompts, **d.kwargs)
    out = generate(d.model, d.prompts, proposer=d.proposer, controller=d.controller, **d.kwargs)
    assert out.tolist() == plain.tolist(), d.kind
    assert out.stats.accepted_per_position[1] > 0  # drafts were accepted at depth 2
