"""The thread count chosen by measurement (``genrec_spec.llm.threads``): the counts timed, the
fastest kept in a file per machine, model shape and batch size and read back, an unreadable file
timed again, a real timing that restores the thread count, and `generate` refusing a negative
count."""

import dataclasses

import pytest
import torch

from genrec_spec.core.types import DecodeInputError
from genrec_spec.llm import threads
from genrec_spec.llm.generation import GenerationConfig, generate_texts


def test_candidate_counts():
    assert threads.candidate_counts(1) == (1,)
    assert threads.candidate_counts(2) == (1, 2)
    assert threads.candidate_counts(6) == (1, 2, 4, 6)
    assert threads.candidate_counts(16) == (1, 2, 4, 8, 16)


def test_the_fastest_count_is_kept_per_model_and_batch(kit, tmp_path, monkeypatch):
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 4)
    timed = []

    def fake(model, batch_size, counts):
        timed.append(batch_size)
        return {1: 3.0, 2: 1.0, 4: 2.0}

    monkeypatch.setattr(threads, "time_threads", fake)
    model = kit.tiny_llama(61, seed=0)
    assert threads.fastest_threads(model, 1, tmp_path) == 2
    assert threads.fastest_threads(model, 1, tmp_path) == 2  # read back, not timed
    assert timed == [1]
    assert threads.fastest_threads(model, 8, tmp_path) == 2  # another batch: timed
    assert threads.fastest_threads(kit.tiny_llama(61, seed=0, dim=64), 1, tmp_path) == 2
    assert timed == [1, 8, 1]  # another model shape: timed
    for file in tmp_path.glob("*.json"):
        file.write_text("{not json")
    assert threads.fastest_threads(model, 1, tmp_path) == 2
    assert timed == [1, 8, 1, 1]  # unreadable: timed again
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 1)
    assert threads.fastest_threads(model, 1, tmp_path) == 1  # one core: nothing to time
    assert len(timed) == 4


def test_timing_a_real_step_restores_the_thread_count(kit):
    before = torch.get_num_threads()
    model = kit.tiny_llama(61, seed=0)
    model.config = dataclasses.replace(model.config, max_seq_len=40)  # shorter than CONTEXT
    seconds = threads.time_threads(model, 2, (1, 2))
    assert set(seconds) == {1, 2} and all(s > 0 for s in seconds.values())
    assert torch.get_num_threads() == before


def test_generate_refuses_a_negative_count():
    with pytest.raises(DecodeInputError, match="--threads"):
        generate_texts(["def f():"], GenerationConfig(threads=-1))
    with pytest.raises(DecodeInputError, match="use a seed from 0 to 2"):  # (torch overflowed)
        generate_texts(["def f():"], GenerationConfig(seed=2**70))
