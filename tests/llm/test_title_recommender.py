"""Catalogue-grounded recommendation with the real SmolLM2: beam search over ML-1M's titles
equals transformers' constrained beam search (native Llama and HFTarget), speculative equals
plain in fewer passes, every result is an item; the CLI and evaluate run on a prepared folder."""

import json
import subprocess
import sys

import pytest
import torch

from genrec_spec import HFTarget
from genrec_spec.core.beam import BeamConfig, beam_search
from genrec_spec.core.catalogue_drafter import CatalogueDrafter
from genrec_spec.llm.title_recommender import TitleRecommender, item_titles


@pytest.fixture(scope="module")
def ml1m_titles():
    from genrec_spec.data_pipelines.loaders import load_dataset
    from genrec_spec.data_pipelines.split import build_item_index, leave_one_out, user_sequences

    raw = load_dataset("ml-1m")
    test = leave_one_out(user_sequences(raw.interactions, build_item_index(raw.items))).test
    histories = [test.values[test.offsets[u] : test.offsets[u + 1]].tolist() for u in (0, 7)]
    return item_titles(raw.items), histories


@pytest.fixture(scope="module")
def hf_smollm2():
    from transformers import AutoModelForCausalLM

    from genrec_spec.models.llm.smollm2 import smollm2_hf_dir

    return AutoModelForCausalLM.from_pretrained(smollm2_hf_dir(), dtype=torch.float32).eval()


def hf_constrained_beam(hf_model, recommender, prompts, config):
    """transformers' generate with prefix_allowed_tokens_fn over the recommender's catalogue."""
    catalogue, eos = recommender.catalogue, recommender.eos

    def allowed_after(width):
        def allowed(batch_id, ids):
            state = torch.zeros(1, dtype=torch.long)
            for token in ids[width:].tolist():
                state = catalogue.advance(state, torch.tensor([token]))
            return catalogue.trie.allowed(state)[0].nonzero().flatten().tolist() or [eos]

        return allowed

    out = []
    for prompt in prompts:
        with torch.inference_mode():
            ids = hf_model.generate(
                torch.tensor([prompt]),
                num_beams=config.num_beams,
                num_return_sequences=config.num_return_sequences,
                max_new_tokens=catalogue.trie.longest,
                eos_token_id=eos,
                pad_token_id=eos,
                do_sample=False,
                prefix_allowed_tokens_fn=allowed_after(len(prompt)),
            )
        rows = ids[:, len(prompt) :].tolist()
        out.append([row[: row.index(eos) + 1] if eos in row else row for row in rows])
    return out


@pytest.mark.slow
def test_title_beam_equals_transformers_and_speculative_equals_plain(
    smollm2_model, hf_smollm2, ml1m_titles
):
    model, tokenizer = smollm2_model
    titles, histories = ml1m_titles
    recommender = TitleRecommender(model, tokenizer, titles)
    prompts = [recommender.prompt(h) for h in histories]
    config = BeamConfig(num_beams=4, num_return_sequences=3)
    kwargs = dict(
        config=config,
        max_new_tokens=recommender.catalogue.trie.longest,
        eos_token_id=recommender.eos,
        constraint=recommender.catalogue,
    )
    theirs = hf_constrained_beam(hf_smollm2, recommender, prompts, config)
    plain = beam_search(model, prompts, **kwargs)  # B = 2, uneven prompts
    assert plain.tolist() == theirs
    through_hf = beam_search(HFTarget(hf_smollm2), prompts, **kwargs)
    assert through_hf.tolist() == theirs
    spec = beam_search(model, prompts, drafter=CatalogueDrafter(recommender.catalogue), **kwargs)
    assert spec.tolist() == plain.tolist()
    assert torch.allclose(spec.scores, plain.scores, atol=1e-4)
    assert spec.stats.target_forwards < plain.stats.target_forwards
    out = recommender.recommend(histories, k=3)
    assert (out.items >= 0).all() and all(len(set(row)) == 3 for row in out.items.tolist())
    # its first search drafts (the record's prior) and is recorded: drafted passes, saved steps
    assert out.stats.draft_nodes > 0 and recommender.record.saved > 0


@pytest.fixture
def smollm2_session(monkeypatch, smollm2_model):
    """The CLI and jobs load SmolLM2 through llm.methods.load_target: hand them the loaded one."""
    from genrec_spec.models.llm import smollm2

    monkeypatch.setattr(smollm2, "load_smollm2", lambda: smollm2_model)


@pytest.mark.slow
def test_recommend_and_evaluate_by_title_on_a_prepared_folder(smollm2_session, tiny_data_dir):
    from genrec_spec.jobs.title_recommend import evaluate_titles, recommend_titles_for

    answer = recommend_titles_for(tiny_data_dir, user_id="u1", k=3)
    assert answer["user_id"] == "u1" and len(answer["items"]) == 3
    assert all(entry["title"].startswith("Movie number") for entry in answer["items"])
    metrics = evaluate_titles(tiny_data_dir, users=2, ks=(3,))
    assert metrics["users"] == 2 and metrics["invalid_items"] == 0
    assert 0.0 <= metrics["hr@3"] <= 1.0 and metrics["target_passes_per_batch"] >= 1


def test_the_cli_refuses_llm_without_data(tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "genrec_spec.cli", "recommend", "--llm", "smollm2", "--user", "u1"],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 2 and "error: --llm needs the prepared data" in run.stderr
    assert "Fix: pass --data DIR" in run.stderr


def test_bad_counts_are_refused_before_the_llm_loads(tiny_data_dir, monkeypatch):
    from genrec_spec.jobs import title_recommend
    from genrec_spec.jobs.title_recommend import evaluate_titles, recommend_titles_for
    from genrec_spec.recsys.errors import RecommendInputError

    class Loaded(Exception):  # the LLM would load here: every check passed
        pass

    def load(*args, **kwargs):
        raise Loaded

    monkeypatch.setattr(title_recommend, "load_title_recommender", load)
    for threads in (0, 10**5):  # (torch raised; 10^5 ran out of memory)
        with pytest.raises(ValueError, match=f"--threads {threads} on a machine of"):
            recommend_titles_for(tiny_data_dir, user_id="u1", threads=threads)
    with pytest.raises(RecommendInputError, match="--k must be >= 1, got 0"):
        recommend_titles_for(tiny_data_dir, user_id="u1", k=0)
    with pytest.raises(RecommendInputError, match="--k 41 is larger than the catalogue"):
        recommend_titles_for(tiny_data_dir, user_id="u1", k=41)
    with pytest.raises(RecommendInputError, match="--k 41 is larger than the catalogue"):
        evaluate_titles(tiny_data_dir, ks=(10, 41))
    for bad in ({"batch_size": 0}, {"seed": 2**70}):  # (torch's messages, after the LLM)
        with pytest.raises(RecommendInputError, match="batch size >= 1 and a seed"):
            evaluate_titles(tiny_data_dir, **bad)
    with pytest.raises(ValueError, match="--users must be >= 0"):
        evaluate_titles(tiny_data_dir, users=-5)
    with pytest.raises(Loaded):  # no --threads: torch's default (a TypeError before)
        evaluate_titles(tiny_data_dir, threads=None)


def test_a_folder_without_titles_is_refused(tiny_data_dir):
    import pandas as pd

    from genrec_spec.jobs.title_recommend import load_title_recommender
    from genrec_spec.recsys.data import load_prepared
    from genrec_spec.recsys.errors import RecommendInputError

    items = pd.read_parquet(tiny_data_dir / "items.parquet").drop(columns=["title", "year"])
    items.to_parquet(tiny_data_dir / "items.parquet", index=False)
    with pytest.raises(RecommendInputError, match="no title column"):
        load_title_recommender(load_prepared(tiny_data_dir))


def test_the_recommend_cli_prints_json_for_llm(smollm2_session, tiny_data_dir, capsys):
    from genrec_spec.cli import main

    assert (
        main(
            [
                "recommend",
                "--llm",
                "smollm2",
                "--data",
                str(tiny_data_dir),
                "--user",
                "u1",
                "--k",
                "2",
                "--json",
            ]
        )
        == 0
    )
    answer = json.loads(capsys.readouterr().out)
    assert answer["llm"] and len(answer["items"]) == 2


def test_an_unknown_pass_cost_is_refused():
    from genrec_spec.core.types import DecodeInputError
    from genrec_spec.llm.title_recommender import TitleRecommenderConfig

    with pytest.raises(DecodeInputError, match="unknown pass_cost"):
        TitleRecommenderConfig(pass_cost="free")


def test_flags_the_llm_does_not_read_are_refused(tiny_data_dir, tmp_path, capsys):
    """Taken silently, --exclude-seen returned the history's own items; --json was checked
    only after the whole evaluation."""
    from genrec_spec.cli import main

    llm = ["--llm", "smollm2", "--data", str(tiny_data_dir)]
    for extra in (["--exclude-seen"], ["--option", "beam_width=2"], ["--decoder", "heads"]):
        assert main(["recommend", *llm, "--user", "u1", *extra]) == 2
        assert f"{extra[0]} do not apply to --llm" in capsys.readouterr().err
    assert main(["evaluate", *llm, "--exclude-history"]) == 2
    assert "--exclude-history do not apply to --llm" in capsys.readouterr().err
    assert main(["evaluate", *llm, "--json", str(tmp_path / "missing" / "x.json")]) == 2
    assert "--json" in capsys.readouterr().err
    # An unknown id quoted, with the JSON form that keeps a title's comma (a title split at its
    # comma read, joined, as the real title)
    assert main(["recommend", *llm, "--history", "i1,Heat, The"]) == 2
    err = capsys.readouterr().err
    assert "'Heat', 'The'" in err and "go as a JSON list" in err
