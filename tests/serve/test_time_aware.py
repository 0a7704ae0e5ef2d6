"""The service with a time-aware model (`models.recsys.times`) over HTTP: a user id reads the
data's times, a history its request's `history_times`, both at the request's `time`; the model
keeps no history cache; a history without times is a clear 400."""

import httpx
import pytest
import torch


@pytest.fixture(scope="module")
def timed(tiny_checkpoint_writer, tmp_path_factory):
    """A Retriever of an untrained tiny HSTU model with position and time biases."""
    from genrec_spec.serve.config import ServeConfig
    from genrec_spec.serve.retrieval import Retriever

    changes = {"block": "hstu", "relative_bias": True, "time_bias": True}
    ckpt = tiny_checkpoint_writer(tmp_path_factory.mktemp("timed"), **changes)
    config = ServeConfig()
    return Retriever.load(ckpt, None, config.max_k, config.history_cache_mb << 20)


def test_a_time_aware_model_reads_the_times_it_is_sent(timed, start_service):
    from genrec_spec.models.recsys.times import HistoryTimes
    from genrec_spec.recsys.recommend import recommend

    assert timed.history_cache is None  # its states depend on each request's time
    history, times = timed.user_history("u2"), timed.user_times("u2")
    at = times[-1] + 3600
    ids = [timed.data.item_ids[i] for i in history]
    bodies = [
        {"user_id": "u2", "k": 5, "time": at},
        {"history": ids, "history_times": times, "k": 5, "time": at, "decoder": "spec_beam"},
        {"history": ids, "k": 5},
        {"history": ids, "history_times": times[:-1], "k": 5},
    ]
    with start_service(recommender=timed) as url, httpx.Client(base_url=url) as client:
        answers = [client.post("/v1/recommend", json=body) for body in bodies]
    assert [a.status_code for a in answers] == [200, 200, 400, 422]
    direct = recommend(
        timed.model, [history], k=5, times=HistoryTimes(torch.tensor(times), torch.tensor([at]))
    )
    want = [timed.data.item_ids[i] for i in direct.items[0].tolist()]
    assert answers[0].json()["items"] == answers[1].json()["items"] == want
    assert "history_times" in answers[2].json()["detail"]
    assert "one timestamp per history item" in answers[3].json()["detail"]
