"""The batch candidate-generation job: rows, plan, exactly-once resume after SIGKILL, refusal of
other arguments, bad input through the CLI, and the Ray engine against the local one."""

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from genrec_spec.cli import main
from genrec_spec.jobs.batch import known_histories, run_batch
from genrec_spec.jobs.batch_chunks import BatchConfig, ChunkDecoder, plan_shards
from genrec_spec.jobs.batch_ray import check_ray_address
from genrec_spec.jobs.batch_store import MANIFEST, open_store, shard_file
from genrec_spec.jobs.errors import BatchOutputError, RayAddressError
from genrec_spec.recsys.checkpoint import load_model_and_data
from genrec_spec.recsys.recommend import recommend

COLUMNS = ["user_id", "item_ids", "scores", "decoder", "model_hash", "data_hash"]
QUIET = {"progress": False}


def read_output(out: Path) -> pd.DataFrame:
    """Every listed shard in shard order; the folder must hold exactly the listed shards."""
    manifest = json.loads((out / MANIFEST).read_text())
    files = sorted(p.name for p in out.glob("part-*.parquet"))
    assert files == [shard_file(s) for s in manifest["completed"]]
    return pd.concat([pd.read_parquet(out / name) for name in files], ignore_index=True)


def assert_same_rows(a: pd.DataFrame, b: pd.DataFrame) -> None:
    """The same users and lists; scores equal up to float rounding (the local engine uses every
    core by default and a Ray actor one, and a matmul's sums run in another order)."""
    assert a["user_id"].tolist() == b["user_id"].tolist()
    assert [list(x) for x in a["item_ids"]] == [list(x) for x in b["item_ids"]]
    for x, y in zip(a["scores"], b["scores"], strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


def test_rows_are_the_recommendations_of_every_known_history(tiny_checkpoint, tmp_path):
    out = tmp_path / "out"
    summary = run_batch(tiny_checkpoint, "all", out, BatchConfig(k=5, shards=1, batch_size=64))
    model, data = load_model_and_data(tiny_checkpoint)
    rows = read_output(out)
    assert list(rows) == COLUMNS and rows["user_id"].tolist() == data.test.user_ids
    assert summary["users_written"] == len(data.test) == 24 and summary["target_passes"] > 0
    # each history is the test history plus the held-out item, decoded as one batch of 24
    test = data.test
    histories = [
        test.values[test.offsets[u] : test.offsets[u + 1]].tolist() + [int(test.targets[u])]
        for u in range(len(test))
    ]
    expected = recommend(model, histories, k=5, decoder="beam")
    assert [list(x) for x in rows["item_ids"]] == [
        [data.item_ids[i] for i in row] for row in expected.items.tolist()
    ]
    assert torch.allclose(torch.from_numpy(np.stack(rows["scores"])), expected.scores, atol=0)
    assert set(rows["decoder"]) == {"beam"} and set(rows["data_hash"]) == {data.data_hash}
    assert json.loads((out / MANIFEST).read_text())["complete"]


def test_plan_is_contiguous_deterministic_and_batched(tiny_model):
    _, data = tiny_model
    histories = known_histories(data.test)
    assert histories.lengths.tolist() == (data.test.lengths + 1).tolist()
    sizes, chunks = plan_shards(histories, shards=5, batch_size=2)
    again = plan_shards(histories, shards=5, batch_size=2)[1]
    assert sizes == [4, 5, 5, 5, 5] and sum(sizes) == len(histories)
    flat = [c for shard in range(5) for c in chunks[shard]]
    assert [u for c in flat for u in c.user_ids] == histories.user_ids
    assert max(len(c.user_ids) for c in flat) == 2
    assert all(c.offsets.numel() == len(c.user_ids) + 1 for c in flat)
    assert [c.user_ids for c in flat] == [c.user_ids for s in range(5) for c in again[s]]
    assert plan_shards(histories.select(torch.arange(3)), shards=8, batch_size=2)[0] == [1, 1, 1]


def test_users_file_subset_in_file_order_and_rerun_is_a_no_op(tiny_checkpoint, tmp_path, capsys):
    users = tmp_path / "users.parquet"
    wanted = ["u7", "u2", "u19", "u0", "u11"]
    pd.DataFrame({"user_id": wanted}).to_parquet(users)
    out = tmp_path / "out"
    args = ["batch", "--ckpt", str(tiny_checkpoint), "--users", str(users), "--out", str(out)]
    args += ["--k", "3", "--shards", "2", "--batch-size", "2", "--no-progress"]
    assert main(args + ["--decoder", "spec_beam", "--option", "beam_width=8"]) == 0
    rows = read_output(out)
    assert rows["user_id"].tolist() == wanted and rows["item_ids"].map(len).tolist() == [3] * 5
    assert set(rows["decoder"]) == {"spec_beam"}
    before = {p.name: p.read_bytes() for p in out.glob("part-*")}
    assert main(args + ["--decoder", "spec_beam", "--option", "beam_width=8"]) == 0
    assert "nothing to do" in capsys.readouterr().out
    assert {p.name: p.read_bytes() for p in out.glob("part-*")} == before
    # other arguments into the same folder: refused, nothing touched
    assert main(args + ["--decoder", "spec_beam", "--option", "beam_width=9"]) == 2
    assert "other arguments" in capsys.readouterr().err
    assert main(args + ["--decoder", "beam"]) == 2
    assert "decoder: 'spec_beam' there, 'beam' now" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in out.glob("part-*")} == before


def test_a_run_failing_before_any_shard_leaves_a_folder_that_takes_new_arguments(
    tiny_checkpoint, tmp_path, monkeypatch
):
    out = tmp_path / "out"
    args = ["batch", "--ckpt", str(tiny_checkpoint), "--users", "all", "--out", str(out)]
    args += ["--k", "6", "--shards", "2", "--no-progress"]
    decode, calls = ChunkDecoder.__call__, []

    def failing(self, *inputs):  # the first user's check decodes; the first chunk fails
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("the worker was lost")
        return decode(self, *inputs)

    monkeypatch.setattr(ChunkDecoder, "__call__", failing)
    with pytest.raises(RuntimeError, match="the worker was lost"):
        main(args + ["--option", "beam_width=8"])
    monkeypatch.undo()
    assert json.loads((out / MANIFEST).read_text())["completed"] == []
    assert not list(out.glob("*.parquet"))
    assert main(args + ["--option", "beam_width=10"]) == 0
    assert len(read_output(out)) == 24


def bad_input_cases(ckpt: Path, tmp: Path, other_data: Path) -> dict:
    """name -> (extra CLI arguments, a phrase of the expected message)."""
    (tmp / "a_file").write_text("x")
    pd.DataFrame({"user_id": ["u1", "nobody", "u3", "ghost"]}).to_parquet(tmp / "unknown.parquet")
    pd.DataFrame({"user": ["u1", "u2"]}).to_parquet(tmp / "no_column.parquet")
    pd.DataFrame({"user_id": ["u1", "u2", "u1"]}).to_parquet(tmp / "twice.parquet")
    return {
        "missing checkpoint": (["--ckpt", str(tmp / "nope")], "has no manifest.json"),
        "data mismatch": (["--data", str(other_data)], "was trained on data"),
        "unwritable out": (["--out", str(tmp / "a_file" / "out")], "cannot write the output"),
        "unknown decoder": (["--decoder", "magic"], "unknown decoder 'magic'"),
        "foreign option": (["--option", "lookahead=true"], "no listed decoder takes"),
        "unknown users": (["--users", str(tmp / "unknown.parquet")], "nobody, ghost"),
        "no user_id column": (["--users", str(tmp / "no_column.parquet")], "no user_id column"),
        "repeated users": (["--users", str(tmp / "twice.parquet")], "more than once"),
        "k too large": (["--k", "1000"], "exceeds the catalogue"),
        "zero shards": (["--shards", "0"], "--shards must be >= 1"),
        # found by the decoder's types or the first user's decode, before any output
        "word for a width": (["--option", "beam_width=wide"], "takes int or null, got 'wide'"),
        "fractional width": (["--option", "beam_width=2.5"], "takes int or null, got 2.5"),
        "width below k": (["--option", "beam_width=3"], "beam_width 3 must be >= k = 5"),
        "address without ray": (["--ray-address", "127.0.0.1:1"], "needs --engine ray"),
    }


def test_bad_input_is_one_clear_error_and_writes_nothing(
    tiny_checkpoint, tiny_prepared, tmp_path, capsys
):
    other = tiny_prepared(tmp_path / "other_data", seed=1)
    cases = bad_input_cases(tiny_checkpoint, tmp_path, other)
    for name, (extra, phrase) in cases.items():
        out = tmp_path / f"out_{name.replace(' ', '_')}"
        base = {"--ckpt": str(tiny_checkpoint), "--users": "all", "--out": str(out), "--k": "5"}
        base.update(dict(zip(extra[::2], extra[1::2], strict=True)))
        args = ["batch", "--no-progress", *[x for kv in base.items() for x in kv]]
        assert main(args) == 2, name
        err = capsys.readouterr().err
        assert phrase in err and "Traceback" not in err, (name, err)
        assert not out.exists(), name


def test_unreachable_ray_address_fails_before_writing(tiny_checkpoint, tmp_path, capsys, free_port):
    port = free_port  # nobody listens on it
    out = tmp_path / "out"
    args = ["batch", "--ckpt", str(tiny_checkpoint), "--users", "all", "--out", str(out)]
    args += ["--engine", "ray", "--ray-address", f"127.0.0.1:{port}", "--no-progress"]
    start = time.perf_counter()
    assert main(args) == 2
    assert "no Ray cluster answers at 127.0.0.1" in capsys.readouterr().err
    assert time.perf_counter() - start < 30 and not out.exists()


@contextlib.contextmanager
def loopback_server(reply: bytes | None) -> Iterator[str]:
    """HOST:PORT of a 127.0.0.1 listener that answers each connection with `reply` and closes it
    (b"": accept and close), or with None holds it open in silence."""
    stop, held = threading.Event(), []
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.settimeout(0.05)

        def serve() -> None:
            while not stop.is_set():
                try:
                    conn, _ = server.accept()
                except TimeoutError:
                    continue
                if reply is None:
                    held.append(conn)
                    continue
                with conn:
                    conn.sendall(reply)

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        try:
            yield f"127.0.0.1:{server.getsockname()[1]}"
        finally:
            stop.set()
            thread.join(5)
            for conn in held:
                conn.close()


def test_a_listening_address_that_is_not_ray_fails_before_writing(
    tiny_checkpoint, tmp_path, capsys
):
    # A gRPC server's first frame: SETTINGS (type 4) holding MAX_CONCURRENT_STREAMS = 100.
    settings = bytes([0, 0, 6, 4, 0, 0, 0, 0, 0]) + bytes([0, 3, 0, 0, 0, 100])
    with loopback_server(settings) as address:
        check_ray_address(address, 2.0)  # passes as a Ray GCS would
    for reply in (None, b"", b"HTTP/1.1 400 Bad Request\r\n\r\n", b"\x00" * 9, settings[:5]):
        with loopback_server(reply) as address:
            with pytest.raises(RayAddressError, match="accepts connections but is not a Ray"):
                check_ray_address(address, 0.5)
    # Through the CLI: exit code 2, one message, no output folder, no Ray started.
    for reply in (b"", b"garbage, not HTTP/2\n" * 20):
        out = tmp_path / "out"
        with loopback_server(reply) as address:
            args = ["batch", "--ckpt", str(tiny_checkpoint), "--users", "all", "--out", str(out)]
            args += ["--engine", "ray", "--ray-address", address, "--no-progress"]
            start = time.perf_counter()
            assert main(args) == 2
        err = capsys.readouterr().err
        assert f"--ray-address {address} accepts connections but is not a Ray cluster" in err
        assert err.count("\n") == 1 and "Traceback" not in err, err
        assert time.perf_counter() - start < 30 and not out.exists()


def test_output_folder_guards(tiny_checkpoint, tmp_path):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(BatchOutputError, match="holds no batch job"):
        run_batch(tiny_checkpoint, "all", foreign, BatchConfig(k=5, **QUIET))
    job = {"k": 1}
    with open_store(tmp_path / "busy", job, [2, 2], {}):
        with pytest.raises(BatchOutputError, match="another `genrec-spec batch`"):
            with open_store(tmp_path / "busy", job, [2, 2], {}):
                pass


@pytest.fixture(scope="module")
def many_users_checkpoint(tmp_path_factory, tiny_prepared) -> Path:
    """An untrained tiny model on 800 users: enough decoder calls to kill a run midway."""
    from genrec_spec.models.recsys.recommender import RecommenderConfig, SemanticIdRecommender
    from genrec_spec.recsys.checkpoint import save_checkpoint
    from genrec_spec.recsys.data import load_prepared

    root = tmp_path_factory.mktemp("many_users")
    data = load_prepared(tiny_prepared(root / "data", users=800))
    torch.manual_seed(0)
    config = RecommenderConfig(dim=16, layers=2, heads=2, dropout=0.0, max_len=12)
    model = SemanticIdRecommender(config, data.item_codes, data.codebook_sizes)
    manifest = {"data": {"path": str(data.path), "data_hash": data.data_hash}}
    save_checkpoint(root / "ckpt", model, manifest)
    return root / "ckpt"


def test_sigkill_midway_then_rerun_gives_every_user_exactly_once(many_users_checkpoint, tmp_path):
    out = tmp_path / "out"
    args = ["batch", "--ckpt", str(many_users_checkpoint), "--users", "all", "--out", str(out)]
    args += ["--k", "10", "--shards", "20", "--batch-size", "4", "--no-progress"]
    env = os.environ | {"PYTHONUNBUFFERED": "1"}
    job = subprocess.Popen(
        [sys.executable, "-m", "genrec_spec.cli", *args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 120
    while not (out / shard_file(0)).exists() and job.poll() is None:
        assert time.monotonic() < deadline, "no shard written in time"
        time.sleep(0.005)
    job.send_signal(signal.SIGKILL)
    job.wait()
    assert job.returncode == -signal.SIGKILL, job.stderr.read().decode()
    manifest = json.loads((out / MANIFEST).read_text())
    # the kill may fall between shard 0's rename and its manifest entry: then none is listed
    assert not manifest["complete"] and len(manifest["completed"]) < 20
    # what a reader sees after the kill: complete shards only, no user twice
    partial = pd.read_parquet(out)
    assert partial["user_id"].is_unique and len(partial) < 800
    (out / ".part-00019.parquet.tmp-left").write_bytes(b"half")  # as if killed mid-write

    assert main(args) == 0
    rows = read_output(out)
    assert len(rows) == 800 and rows["user_id"].is_unique
    assert not list(out.glob(".*tmp*"))
    fresh = tmp_path / "fresh"
    run_batch(
        many_users_checkpoint, "all", fresh, BatchConfig(k=10, shards=20, batch_size=4, **QUIET)
    )
    assert_same_rows(rows, read_output(fresh))
    resumed = sum(manifest["shard_users"][s] for s in manifest["completed"])
    assert json.loads((out / MANIFEST).read_text())["runs"][-1]["users_resumed"] == resumed


def test_ray_engine_writes_the_local_engines_rows(tiny_checkpoint, tmp_path):
    config = BatchConfig(k=4, shards=3, batch_size=4, **QUIET)
    run_batch(tiny_checkpoint, "all", tmp_path / "local", config)
    ray_config = BatchConfig(
        k=4, shards=3, batch_size=4, engine="ray", actors=2, ray_cpus=2, **QUIET
    )
    summary = run_batch(tiny_checkpoint, "all", tmp_path / "ray", ray_config)
    assert summary["users_written"] == 24 and summary["batches"] == 6
    local, ray_rows = read_output(tmp_path / "local"), read_output(tmp_path / "ray")
    assert list(ray_rows) == COLUMNS
    assert_same_rows(local, ray_rows)
    assert local[COLUMNS[3:]].equals(ray_rows[COLUMNS[3:]])


def test_a_time_aware_model_reads_the_data_times_on_either_engine(tiny_checkpoint_writer, tmp_path):
    """With a time-aware model every user's known history comes with the data's timestamps and
    the list is for the time of their last interaction; the Ray engine ships the times to its
    actors and writes the local engine's rows."""
    from genrec_spec.models.recsys.times import HistoryTimes

    changes = {"block": "hstu", "relative_bias": True, "time_bias": True}
    ckpt = tiny_checkpoint_writer(tmp_path / "timed", **changes)
    config = BatchConfig(k=4, shards=2, batch_size=8, **QUIET)
    run_batch(ckpt, "all", tmp_path / "local", config)
    run_batch(
        ckpt,
        "all",
        tmp_path / "ray",
        BatchConfig(k=4, shards=2, batch_size=8, engine="ray", **QUIET),
    )
    local, ray_rows = read_output(tmp_path / "local"), read_output(tmp_path / "ray")
    assert_same_rows(local, ray_rows)
    model, data = load_model_and_data(ckpt)
    known = known_histories(data.test)
    last = known.offsets[1:] - 1
    times = HistoryTimes(known.times, known.times[last])
    expected = recommend(model, (known.values, known.offsets), k=4, times=times)
    assert [list(x) for x in local["item_ids"]] == [
        [data.item_ids[i] for i in row] for row in expected.items.tolist()
    ]
