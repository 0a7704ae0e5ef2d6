"""The real service over HTTP: every endpoint, the OpenAPI schema, metrics, the API key,
overload (503 + Retry-After), timeouts (504) and every kind of bad input (4xx, never 500)."""

import asyncio
import copy

import httpx
import openapi_spec_validator
import pytest
from openapi_spec_validator.validation.exceptions import OpenAPIValidationError


def test_health_ready_users(service):
    with httpx.Client(base_url=service) as client:
        assert client.get("/healthz").json() == {"status": "ok"}
        ready = client.get("/readyz")
        assert ready.status_code == 200
        assert ready.json() == {"ready": True, "components": {"recommender": "ready", "llm": "off"}}
        users = client.get("/v1/users", params={"limit": 5, "offset": 2}).json()
        assert users["users"] == [f"u{i}" for i in range(2, 7)] and users["total"] == 24


def test_recommend_by_user_and_history(service, retriever):
    bodies = [
        {"user_id": "u3", "k": 5},
        {"user_id": "u4", "k": 5, "decoder": "heads", "exclude_seen": True},
        {"history": ["i1", "i2", "i3"], "k": 7, "decoder": "spec_beam"},
        {"history": [], "k": 3, "decoder": "nezha", "options": {"beam_width": 8}},
    ]
    with httpx.Client(base_url=service) as client:
        answers = [client.post("/v1/recommend", json=body) for body in bodies]
    assert [a.status_code for a in answers] == [200] * 4
    by_user, excluded, by_history, cold = (a.json() for a in answers)
    catalogue = set(retriever.data.item_ids)
    for body, answer in zip(bodies, (by_user, excluded, by_history, cold), strict=True):
        assert len(answer["items"]) == len(answer["scores"]) == body["k"]
        assert set(answer["items"]) <= catalogue and len(set(answer["items"])) == body["k"]
        assert answer["scores"] == sorted(answer["scores"], reverse=True)
        assert answer["latency_ms"] > 0 and answer["stats"]["target_passes"] >= 1
    seen = {retriever.data.item_ids[i] for i in retriever.user_history("u4")}
    assert excluded["excluded"] == len(seen) and not seen & set(excluded["items"])
    assert by_user["history_length"] == len(retriever.user_history("u3"))
    assert by_history["history_length"] == 3 and cold["cold_start"]


def test_openapi_schema(service):
    schema = httpx.get(f"{service}/openapi.json").json()
    assert schema["openapi"].startswith("3.")
    # Valid against the OpenAPI specification of its version, every $ref resolved.
    openapi_spec_validator.validate(schema)
    broken = copy.deepcopy(schema)  # the validator does reject what the specification forbids
    del broken["paths"]["/healthz"]["get"]["responses"]["200"]["description"]
    with pytest.raises(OpenAPIValidationError, match="'description' is a required property"):
        openapi_spec_validator.validate(broken)
    paths = {"/healthz", "/readyz", "/metrics", "/v1/users", "/v1/recommend", "/v1/generate"}
    assert paths <= set(schema["paths"])
    for path, methods in schema["paths"].items():
        for operation in methods.values():
            assert "200" in operation["responses"], path
    models = schema["components"]["schemas"]
    for name in ("RecommendRequest", "RecommendResponse", "GenerateRequest", "ErrorResponse"):
        assert name in models
    assert "APIKeyHeader" in schema["components"]["securitySchemes"]


def test_metrics_after_traffic(start_service):
    with start_service(max_wait_ms=500) as url:

        async def burst():
            async with httpx.AsyncClient(base_url=url) as client:
                bodies = [{"user_id": f"u{i}", "decoder": "beam"} for i in range(6)]
                bodies += [{"user_id": "u1", "decoder": "heads"}, {"user_id": "nobody"}]
                return await asyncio.gather(*(client.post("/v1/recommend", json=b) for b in bodies))

        statuses = [r.status_code for r in asyncio.run(burst())]
        assert statuses == [200] * 7 + [400]
        assert httpx.get(f"{url}/v2/nothing").status_code == 404
        text = httpx.get(f"{url}/metrics").text
    assert (
        'genrec_spec_request_seconds_bucket{le="0.005",path="/v1/recommend",status="200"}' in text
    )
    assert 'genrec_spec_request_seconds_count{path="/v1/recommend",status="400"} 1.0' in text
    assert 'genrec_spec_request_seconds_count{path="other",status="404"} 1.0' in text
    assert 'genrec_spec_batch_size_count{kind="recommend"} 2.0' in text  # one beam, one heads
    assert 'genrec_spec_batch_size_bucket{kind="recommend",le="4.0"} 1.0' in text
    assert 'genrec_spec_target_passes_total{kind="recommend",method="beam"} 3.0' in text
    assert 'genrec_spec_target_passes_total{kind="recommend",method="heads"} 1.0' in text
    assert 'genrec_spec_mean_accepted_length{kind="recommend",method="beam"} 1.0' in text
    assert 'genrec_spec_mean_accepted_length{kind="recommend",method="heads"} 3.0' in text
    assert 'genrec_spec_errors_total{kind="bad_request"} 1.0' in text
    assert 'genrec_spec_queue_waiting{kind="recommend"} 0.0' in text
    # Every answered history was served one way by the history cache (which way depends on the
    # histories earlier tests left in the session's cache).
    rows = [line for line in text.splitlines() if line.startswith("genrec_spec_history_rows_total")]
    assert sum(float(line.split()[-1]) for line in rows) == 7


def test_history_cache_serves_a_returning_user(service):
    body = {"history": ["i5", "i9", "i2", "i7"], "k": 6, "decoder": "nezha"}
    with httpx.Client(base_url=service) as client:
        first = client.post("/v1/recommend", json=body).json()
        again = client.post("/v1/recommend", json=body).json()
        grown = client.post("/v1/recommend", json=body | {"history": [*body["history"], "i4"]})
    assert again["stats"]["history_exact"] == 1 and again["items"] == first["items"]
    assert grown.json()["stats"]["history_extended"] == 1


def test_api_key(start_service):
    body = {"user_id": "u1", "k": 3}
    with start_service(api_key="s3cret") as url, httpx.Client(base_url=url) as client:
        assert client.get("/healthz").status_code == 200
        assert client.get("/readyz").status_code == 200
        for headers in ({}, {"X-API-Key": "wrong"}):
            refused = client.post("/v1/recommend", json=body, headers=headers)
            assert refused.status_code == 401 and refused.json()["kind"] == "unauthorized"
            assert client.get("/v1/users", headers=headers).status_code == 401
        ok = client.post("/v1/recommend", json=body, headers={"X-API-Key": "s3cret"})
        assert ok.status_code == 200 and len(ok.json()["items"]) == 3


def test_full_queue_is_refused_with_retry_after(start_service):
    # The first request waits max_wait_ms for company, so the queue of 2 is full at the third.
    with start_service(max_queue=2, max_batch=8, max_wait_ms=1500, retry_after_s=3) as url:

        async def burst():
            async with httpx.AsyncClient(base_url=url, timeout=10) as client:
                first = [
                    asyncio.create_task(client.post("/v1/recommend", json={"user_id": f"u{i}"}))
                    for i in range(2)
                ]
                await asyncio.sleep(0.3)
                late = await asyncio.gather(
                    *(client.post("/v1/recommend", json={"user_id": "u5"}) for _ in range(3))
                )
                return await asyncio.gather(*first), late

        first, late = asyncio.run(burst())
    assert [r.status_code for r in first] == [200, 200]
    assert {r.json()["batch_size"] for r in first} == {2}
    for refused in late:
        assert refused.status_code == 503 and refused.headers["Retry-After"] == "3"
        assert refused.json()["kind"] == "overloaded"


def test_request_timeout(start_service):
    with start_service(timeout_s=0.2, max_wait_ms=1000) as url:
        answer = httpx.post(f"{url}/v1/recommend", json={"user_id": "u1"}, timeout=10)
    assert answer.status_code == 504 and answer.json()["kind"] == "timeout"
    assert "0.2 s" in answer.json()["detail"]


BAD_BODIES = [
    ({"user_id": "u1", "k": "ten"}, 422, "k"),
    ({"user_id": "u1", "k": 2.5}, 422, "k"),
    ({"user_id": "u1", "k": True}, 422, "k"),
    ({"user_id": 7}, 422, "user_id"),
    ({"history": "i1,i2"}, 422, "history"),
    ({"history": [["i1"]]}, 422, "history"),
    ({"history": [True, "i1"]}, 422, "history"),  # not item 1
    ({"user_id": "u1", "decoder": "greedy"}, 422, "decoder"),
    ({"user_id": "u1", "k": 0}, 422, "greater than or equal to 1"),
    ({"user_id": "u1", "k": 41}, 400, "at most 40"),
    ({"user_id": "u1", "history": ["i1"]}, 422, "exactly one"),
    ({}, 422, "exactly one"),
    ({"user_id": "u1", "decoders": "beam"}, 422, "decoders"),
    ({"user_id": "nobody"}, 400, "unknown user_id 'nobody'"),
    ({"history": ["i1", "i999", "zz"]}, 400, "2 unknown item id(s) in history: i999, zz"),
    ({"user_id": "u1", "options": {"width": 3}}, 400, "takes no option(s) ['width']"),
    ({"user_id": "u1", "options": {"beam_width": "wide"}}, 400, "takes int or null"),
    ({"user_id": "u1", "options": {"beam_width": 3}}, 400, "must be >= k"),
    # k = 10 fits the width, the history the list leaves out does not
    ({"user_id": "u1", "exclude_seen": True, "options": {"beam_width": 10}}, 400, "leaving out"),
    ({"user_id": "u1", "options": {"beam_width": 10**9}}, 400, "must lie in 0..40"),
    ({"user_id": "u1", "decoder": "rpg", "options": {"mode": "fast"}}, 400, "mode"),
    ({"user_id": "u1", "options": {"beam_width": {"a": 1}}}, 422, "options"),
    ([1, 2], 422, "body"),
]


@pytest.mark.parametrize(("body", "status", "says"), BAD_BODIES)
def test_bad_input_is_a_clear_4xx(service, body, status, says):
    answer = httpx.post(f"{service}/v1/recommend", json=body)
    assert answer.status_code == status, answer.text
    detail = answer.json()["detail"]
    assert says in detail and detail.count("Fix:") == 1, detail  # one problem, one fix


def test_malformed_oversized_and_unknown(service):
    with httpx.Client(base_url=service) as client:
        malformed = client.post(
            "/v1/recommend", content=b'{"user_id": ', headers={"content-type": "application/json"}
        )
        assert malformed.status_code == 422 and "malformed JSON" in malformed.json()["detail"]
        big = {"history": ["i1"] * 20_000}
        assert client.post("/v1/recommend", json=big).status_code == 413

        def chunks():  # no Content-Length: the limit is counted while reading
            yield b'{"user_id": "u1", "pad": "'
            yield b"x" * 70_000
            yield b'"}'

        chunked = client.post("/v1/recommend", content=chunks())
        assert chunked.status_code == 413 and chunked.json()["kind"] == "too_large"
        assert client.get("/v2/recommend").status_code == 404
        assert client.get("/v1/recommend").status_code == 405
        no_llm = client.post("/v1/generate", json={"prompt": "hello"})
        assert no_llm.status_code == 404 and "--llm smollm2" in no_llm.json()["detail"]
        by_title = client.post("/v1/recommend", json={"user_id": "u1", "decoder": "llm"})
        assert by_title.status_code == 404 and "--llm smollm2" in by_title.json()["detail"]
        assert client.post("/v1/generate", json={"prompt": ""}).status_code == 422
        # a seed past torch's int64 ("Overflow when unpacking long long" from the model before)
        huge_seed = client.post("/v1/generate", json={"prompt": "x", "seed": 2**70})
        assert huge_seed.status_code == 422 and "seed" in huge_seed.json()["detail"]
        beams = {"prompt": "x", "num_beams": 2}
        refused = {  # beam search settings that cannot work, refused before the LLM is asked
            "deterministic": {"temperature": 0.5},
            "cannot draft for beam search": {"method": "lookahead"},
            "larger than num_beams": {"num_return_sequences": 3},
        }
        for message, change in refused.items():
            answer = client.post("/v1/generate", json=beams | change)
            assert answer.status_code == 422 and message in answer.json()["detail"], answer.text
