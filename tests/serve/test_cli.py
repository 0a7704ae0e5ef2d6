"""`genrec-spec serve` (a real subprocess) and `genrec-spec loadtest` against a real service."""

import argparse
import json
import os
import subprocess
import sys
import time

import httpx
import pytest

from genrec_spec.cli import loadtest as loadtest_cli
from genrec_spec.cli import main
from genrec_spec.serve import loadtest


def _loadtest(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    loadtest_cli.add_arguments(parser)
    return loadtest_cli.run(parser.parse_args(list(argv)))


def test_loadtest_reports_every_level(start_service, tmp_path, capsys):
    report = tmp_path / "load.json"
    with start_service(api_key="k3y") as url:
        argv = ["--url", url, "--concurrency", "1,4", "--seconds", "0.4", "--decoder", "heads"]
        assert _loadtest(*argv, "--api-key", "k3y", "--json", str(report)) == 0
        with pytest.raises(loadtest.LoadtestError, match="answered 401"):
            _loadtest(*argv)
    table = capsys.readouterr().out
    assert "p50 ms" in table and "req/s" in table
    results = json.loads(report.read_text())["results"]
    assert [r["concurrency"] for r in results] == [1, 4]
    for level in results:
        assert level["requests"] > 0 and level["errors"] == 0
        assert 0 < level["p50_ms"] <= level["p99_ms"]
        assert level["seconds"] < 0.4 + 5  # the level's time bound (+ one request timeout)


def test_loadtest_request_budget(service, tmp_path):
    report = tmp_path / "load.json"
    argv = ["--url", service, "--concurrency", "2,3", "--seconds", "60", "--max-requests", "7"]
    start = time.perf_counter()
    assert _loadtest(*argv, "--warmup", "0", "--json", str(report)) == 0
    assert time.perf_counter() - start < 30
    assert [r["requests"] for r in json.loads(report.read_text())["results"]] == [7, 7]


@pytest.mark.parametrize("url", ["http://example.com:8080", "http://10.0.0.7:80", "ftp://[::1]"])
def test_loadtest_refuses_other_hosts(url, capsys):
    assert main(["loadtest", "--url", url, "--seconds", "1"]) == 2
    assert "loadtest" in capsys.readouterr().err


def test_loadtest_concurrency_is_capped(capsys):
    cap = loadtest.MAX_CONCURRENCY
    assert cap == 1024
    assert loadtest_cli._concurrency_levels(f"1,{cap}") == (1, cap)
    for levels in (f"1,{cap + 1}", "0", "100000"):  # refused while parsing: no client is made
        with pytest.raises(SystemExit) as exit_:
            main(["loadtest", "--url", "http://127.0.0.1:9", "--concurrency", levels])
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert f"give one or more counts from 1 to {cap}" in err and levels in err, err


def test_loadtest_accepts_loopback_urls():
    for url in (
        "http://127.0.0.1:8080/",
        "http://localhost:1",
        "http://[::1]:9",
        "http://127.3.2.1",
    ):
        assert loadtest.check_url(url) == url.rstrip("/")
    assert loadtest.percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.0
    assert loadtest.percentile([float(i) for i in range(1, 101)], 99) == 99.0


def test_serve_bad_checkpoint_or_data_is_a_clear_error(
    tiny_checkpoint, tiny_prepared, tmp_path, capsys, monkeypatch
):
    def no_server(*args, **kwargs):
        raise AssertionError("the server was started")

    monkeypatch.setattr("uvicorn.run", no_server)  # each case must fail before serving
    assert main(["serve", "--ckpt", str(tmp_path / "missing")]) == 2
    assert "has no" in capsys.readouterr().err
    assert main(["serve", "--ckpt", str(tmp_path), "--max-batch", "0"]) == 2
    assert "max_batch=0" in capsys.readouterr().err
    # --data of another prepared folder: its item indices would name other items.
    other = tiny_prepared(tmp_path / "other_data", seed=1)
    assert main(["serve", "--ckpt", str(tiny_checkpoint), "--data", str(other)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert f"checkpoint {tiny_checkpoint} was trained on data " in err
    assert f"{other} holds data " in err and "pass --data with the folder it was trained" in err


def test_serve_command_in_a_subprocess(tiny_checkpoint, free_port):
    port = free_port
    env = os.environ | {"GENREC_SPEC_API_KEY": "from-env"}
    command = [sys.executable, "-m", "genrec_spec.cli", "serve", "--ckpt", str(tiny_checkpoint)]
    command += ["--port", str(port), "--log-level", "warning"]
    server = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, server.stdout.read().decode()
            try:
                if httpx.get(f"{url}/readyz").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not become ready"
            time.sleep(0.2)
        body = {"user_id": "u2", "k": 4}
        assert httpx.post(f"{url}/v1/recommend", json=body).status_code == 401
        answer = httpx.post(f"{url}/v1/recommend", json=body, headers={"X-API-Key": "from-env"})
        assert answer.status_code == 200 and len(answer.json()["items"]) == 4
    finally:
        server.terminate()
        server.wait(timeout=30)
