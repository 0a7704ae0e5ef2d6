"""The two helpers every timed choice rests on: `machine.time_in_turns` (the calls take turns
in an order rotating every round, a warm-up round is not counted, `after` runs untimed after
each call) and
`atomic.json_made_once` (a record made once, read back, made again when unreadable or
rejected)."""

import json

from genrec_spec.data_pipelines.atomic import json_made_once
from genrec_spec.machine import time_in_turns


def test_time_in_turns_alternates_and_skips_the_warm_up():
    order = []
    seconds = time_in_turns(
        {key: (lambda key=key: order.append(key)) for key in "abc"},
        repeats=3,
        after=lambda key: order.append(f"after {key}"),
    )
    rounds = ["abc", "bca", "cab", "abc"]  # warm-up, then 3 timed rounds, each one turned
    assert order == [step for r in rounds for key in r for step in (key, f"after {key}")]
    assert set(seconds) == set("abc") and all(s >= 0 for s in seconds.values())


def test_json_made_once(tmp_path):
    made = []

    def make():
        made.append(1)
        return {"value": len(made)}

    file = tmp_path / "sub" / "record.json"
    assert json_made_once(file, make) == {"value": 1}
    assert json_made_once(file, make) == {"value": 1} and len(made) == 1  # read back
    assert json.loads(file.read_text()) == {"value": 1}
    assert file.stat().st_mode & 0o777 == 0o644  # (the temporary file's 0600 would hide it)
    assert json_made_once(file, make, valid=lambda r: r["value"] > 1) == {"value": 2}
    file.write_text("{not json")
    assert json_made_once(file, make) == {"value": 3}
    assert [p.name for p in file.parent.iterdir()] == ["record.json"]  # no temporary left
