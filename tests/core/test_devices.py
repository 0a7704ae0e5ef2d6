"""Every tensor a decode creates names its device: the search's tables live beside the target's
outputs, so one left on the default device (the CPU) breaks a decode on a GPU. A GPU finds such
a tensor only when it runs; this finds it on any machine, by watching every tensor constructor
called without ``device=`` from the package's code during a warm decode (the first call builds
what a decoder caches, such as the catalogue, on the CPU and moves it, once)."""

from __future__ import annotations

import traceback
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors

from genrec_spec import CallableTarget
from genrec_spec.bench import recsys as bench_recsys
from genrec_spec.core.beam import BeamConfig, beam_search
from genrec_spec.core.catalogue_drafter import CatalogueDrafter
from genrec_spec.core.constraints import AllowedTokens, Catalogue
from genrec_spec.core.prompt_lookup import PromptLookupDrafter
from genrec_spec.recsys.item_trie import item_trie

REPO = Path(__file__).resolve().parents[2]
OURS = tuple(str(REPO / d) for d in ("genrec_spec", "models", "kernels", "data_pipelines"))
CONSTRUCTORS = _device_constructors()


class DevicelessConstructors(TorchFunctionMode):
    """Counts, by the package's line that called it, each tensor constructor without a device
    (``as_tensor`` of a tensor keeps that tensor's device and is not counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: Counter[str] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        copies = func in (torch.as_tensor, torch.asarray) and isinstance(args[0], torch.Tensor)
        if func in CONSTRUCTORS and kwargs.get("device") is None and not copies:
            caller = traceback.extract_stack(limit=2)[0]  # (a test's model is not ours)
            if caller.filename.startswith(OURS):
                self.sites[f"{caller.filename}:{caller.lineno} {func.__name__}"] += 1
        return func(*args, **kwargs)


def deviceless_sites(decode) -> Counter[str]:
    decode()  # builds what the decoder caches
    with torch.no_grad(), DevicelessConstructors() as watch:
        decode()
    return watch.sites


@pytest.mark.parametrize("row", bench_recsys.ROWS)
def test_every_recommender_decoder_names_its_devices(tiny_model, row):
    model, data = tiny_model
    users = data.test.select(torch.arange(3))
    trie = item_trie(model)
    decode = bench_recsys.make_decoders((row,), 8)[row]
    sites = deviceless_sites(lambda: decode(model, users.values, users.offsets, k=3, trie=trie))
    assert not sites, sites


def test_the_engines_beam_search_names_its_devices(tiny):
    vocab, eos = 40, 3
    prompts = [[5, 9, 2, 33, 7, 1, 5, 9], [4, 7], [12, 30, 3, 20, 22]]
    target = CallableTarget(tiny.HashLM(vocab, seed=5, scale=1.5), vocab)
    sequences = [[(7 * i + j) % 36 + 4 for j in range(1 + i % 4)] for i in range(30)]
    catalogue = Catalogue.of(sequences, vocab, eos_token_id=eos)
    hook = AllowedTokens(lambda row, sequence: list(range(4, vocab)), vocab)
    config = BeamConfig(num_beams=4, num_return_sequences=2)
    runs = {
        "catalogue": dict(constraint=catalogue),
        "catalogue drafts": dict(constraint=catalogue, drafter=CatalogueDrafter(catalogue)),
        "prompt lookup": dict(drafter=PromptLookupDrafter(depth=3)),
        "hook": dict(constraint=hook),
    }
    for name, kwargs in runs.items():
        sites = deviceless_sites(
            lambda kw=kwargs: beam_search(
                target, prompts, config=config, max_new_tokens=6, eos_token_id=eos, **kw
            )
        )
        assert not sites, (name, sites)


def test_the_engines_generation_names_its_devices(tiny):
    from genrec_spec import SamplingParams, generate
    from genrec_spec.llm.proposers.ngram import PromptLookup

    vocab, eos = 40, 3
    prompts = [[5, 9, 2, 33, 7, 1, 5, 9], [4, 7], [12, 30, 3, 20, 22]]
    target = CallableTarget(tiny.HashLM(vocab, seed=5, scale=1.5), vocab)
    catalogue = Catalogue.of([[4 + i % 30, 5 + i % 7] for i in range(30)], vocab, eos)
    runs = {
        "greedy": {},
        "sampling": dict(sampling=SamplingParams(temperature=0.8)),
        "prompt lookup": dict(proposer=PromptLookup(k=3)),
        "sampled prompt lookup": dict(
            proposer=PromptLookup(k=3), sampling=SamplingParams(temperature=0.8)
        ),
        "catalogue": dict(constraint=catalogue),
    }
    for name, kwargs in runs.items():
        sites = deviceless_sites(
            lambda kw=kwargs: generate(
                target,
                prompts,
                max_new_tokens=6,
                eos_token_id=eos,
                generator=torch.Generator().manual_seed(0),
                **kw,
            )
        )
        assert not sites, (name, sites)
