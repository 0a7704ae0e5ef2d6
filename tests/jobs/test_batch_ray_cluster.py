"""The batch job on a real Ray cluster started here: a head and a second node (`ray start`), the
job joined with --ray-address, the second node killed mid-run (Ray goes on without it), then the
job's driver killed too, and the job rerun on the head alone: the output holds every user exactly
once, with the local engine's lists."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest

from genrec_spec.jobs.batch import run_batch
from genrec_spec.jobs.batch_chunks import BatchConfig
from genrec_spec.jobs.batch_store import MANIFEST

RAY = Path(sys.executable).parent / "ray"
USERS, SHARDS = 240, 60  # 4 users a shard


def _ray(args: list[str], env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([str(RAY), *args], env=env, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


def _alive_nodes(address: str, env: dict) -> int:
    status = _ray(["status", f"--address={address}"], env, timeout=60).stdout
    active = status.split("Active:", 1)[-1].split("Pending:", 1)[0]
    return active.count("node_")


def _start_node(args: list[str], env: dict, log: Path) -> subprocess.Popen:
    """`ray start ... --block` in a process group of its own: killing the group kills the
    node, and nothing else of Ray on this machine (as `ray stop` would)."""
    with log.open("w") as sink:
        return subprocess.Popen([str(RAY), "start", "--block", *args], env=env, stdout=sink,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip


def _stop(node: subprocess.Popen) -> None:
    if node.poll() is None:
        os.killpg(node.pid, signal.SIGTERM)  # `ray start --block` stops its node's processes
        try:
            node.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(node.pid, signal.SIGKILL)


@pytest.fixture
def cluster(free_port, tmp_path):
    """A head (1 CPU) and a second node (1 CPU), each a `ray start --block` process group, with
    token authentication on, as Ray has it by default."""
    env = os.environ | {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    address = f"127.0.0.1:{free_port}"
    local = ["--node-ip-address=127.0.0.1", "--num-cpus=1", "--disable-usage-stats"]
    head_args = ["--head", f"--port={free_port}", "--include-dashboard=false", *local]
    head = _start_node(head_args, env, tmp_path / "head.log")
    node = None
    try:
        deadline = time.monotonic() + 90
        while _alive_nodes(address, env) < 1:
            if head.poll() is not None:
                pytest.skip(f"`ray start --head` is impossible here: "
                            f"{(tmp_path / 'head.log').read_text()[-800:]}")  # fmt: skip
            assert time.monotonic() < deadline, "the head did not start within 90 s"
            time.sleep(1)
        node = _start_node([f"--address={address}", *local], env, tmp_path / "node.log")
        while _alive_nodes(address, env) < 2:
            assert node.poll() is None, (tmp_path / "node.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "the second node did not join within 90 s"
            time.sleep(1)
        yield SimpleNamespace(address=address, env=env, node=node)
    finally:
        for process in (node, head):
            if process is not None:
                _stop(process)


@pytest.fixture
def checkpoint(tiny_checkpoint_writer, tmp_path) -> Path:
    """An untrained tiny model over USERS users: enough chunks to kill a node while they run."""
    return tiny_checkpoint_writer(tmp_path / "tiny", users=USERS)


def _shards_done(out: Path) -> int:
    manifest = out / MANIFEST
    return len(json.loads(manifest.read_text())["completed"]) if manifest.exists() else 0


def test_a_node_killed_mid_run_loses_no_user_and_repeats_none(cluster, checkpoint, tmp_path):
    out = tmp_path / "out"
    job = [sys.executable, "-m", "genrec_spec.cli", "batch", "--ckpt", str(checkpoint)]
    job += ["--users", "all", "--out", str(out), "--k", "5", "--shards", str(SHARDS)]
    job += ["--batch-size", "1", "--engine", "ray", "--ray-address", cluster.address]
    job += ["--no-progress"]
    log = tmp_path / "driver.log"  # a file, not a pipe: Ray's notices could fill a pipe
    with log.open("w") as sink:
        driver = subprocess.Popen(job + ["--actors", "2"], env=cluster.env, stdout=sink,
                                  stderr=subprocess.STDOUT)  # fmt: skip
    deadline = time.monotonic() + 180
    while _shards_done(out) == 0:  # the pool runs on both nodes: kill one mid-run
        assert driver.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, "no shard written within 180 s"
        time.sleep(0.05)
    os.killpg(cluster.node.pid, signal.SIGKILL)  # the node dies: no clean shutdown
    done_at_kill = _shards_done(out)
    assert done_at_kill < SHARDS, "the job ended before the node was killed"
    # Ray marks the node dead, retries its chunks on the head's actor and goes on; then the
    # driver dies too, mid-run (as when the machine it runs on goes).
    while _shards_done(out) < done_at_kill + 3:
        assert driver.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline + 120, "no progress after the node was lost"
        time.sleep(0.05)
    driver.kill()
    driver.wait()
    users_before = 4 * _shards_done(out)  # shards of USERS / SHARDS users
    assert users_before < USERS, "the job ended before its driver was killed"
    # The rerun, with one actor (the head's one CPU), writes exactly the missing shards.
    resumed = subprocess.run(job + ["--actors", "1"], env=cluster.env, text=True,
                             capture_output=True, timeout=300)  # fmt: skip
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    written = f"({USERS - users_before} written now, {users_before} from earlier runs)"
    assert written in resumed.stdout, resumed.stdout[-2000:]
    rows = pd.concat([pd.read_parquet(p) for p in sorted(out.glob("part-*.parquet"))])
    assert _shards_done(out) == SHARDS == len(list(out.glob("part-*.parquet")))
    assert rows["user_id"].is_unique and len(rows) == USERS  # every user exactly once
    local = tmp_path / "local"
    run_batch(
        checkpoint, "all", local, BatchConfig(k=5, shards=SHARDS, batch_size=1, progress=False)
    )
    expected = pd.concat([pd.read_parquet(p) for p in sorted(local.glob("part-*.parquet"))])
    assert rows["user_id"].tolist() == expected["user_id"].tolist()
    assert [list(x) for x in rows["item_ids"]] == [list(x) for x in expected["item_ids"]]
