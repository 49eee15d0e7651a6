"""``report.html`` and ``rankboard export`` carry the line and the superseded records
(PROTOCOL 8.1): the data only (the page draws them). A data dir written by the broker's real
journal code, a real ``rankboard export`` process, and the web's report of the same run."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from broker import feed
from tests.broker.test_attempts import epoch, reg, steps
from tests.broker.test_journal_steps import Broker
from tests.web.test_report import data_of, export
from web.app import create_app
from web.hub import Hub

RUN = "r"


def restarted_run(data: Path) -> Broker:
    """Attempt 0: steps 0-29, epochs 0-2; attempt 1 resumes at step 10 / epoch 1."""
    b = Broker(data)
    for f in (reg(0, 2, "a0"), reg(1, 2, "a1"), steps(0, 0, 30, 1.0), steps(1, 0, 30, 1.0)):
        assert b.send(f)
    for e in range(3):
        assert b.send(epoch(0, e, 1.0)) and b.send(epoch(1, e, 1.0))
    b.tick(1.5)
    for f in (reg(0, 2, "b0"), reg(1, 2, "b1"), steps(0, 10, 20, 2.0), steps(1, 10, 20, 2.0),
              epoch(0, 1, 2.0), epoch(1, 1, 2.0)):
        assert b.send(f)
    b.tick(1.5)
    return b


def check(d: dict[str, Any]) -> None:
    snap = d["snapshot"]
    assert snap["attempt"] == 1 and len(snap["attempts"]) == 2
    assert [(r["epoch"], r["attempt"]) for r in snap["records"]] == [(0, 0), (1, 1)]
    loss = d["series"]["loss"]
    assert loss[0][0] == 0 and loss[-1][1] == 19 and sum(b[7] for b in loss) == 20
    (sup,) = d["superseded"]
    assert sup["attempt"] == 0
    old = sup["series"]["loss"]
    assert old[0][0] == 10 and old[-1][1] == 29 and {b[2] for b in old} == {1.0}
    assert sum(b[7] for b in old) == 20
    assert [(r["epoch"], r["attempt"]) for r in sup["epochs"]] == [(1, 0), (2, 0)]


def test_export_carries_the_line_and_the_superseded_records(tmp_path: Path) -> None:
    data = tmp_path / "data"
    restarted_run(data).close()
    got = export(RUN, "-o", str(tmp_path / "r.html"), "--data-dir", str(data), cwd=tmp_path)
    assert got.returncode == 0, got.stderr
    check(data_of((tmp_path / "r.html").read_text()))


def test_the_webs_report_carries_them_too(tmp_path: Path) -> None:
    b = restarted_run(tmp_path / "data")
    try:
        hub = Hub()
        hub.next_request()
        hub.handle_snapshot(feed.encode_run_snapshot(b.sinks[RUN].snapshot()))
        hub.handle_snapshot(feed.encode_snapshot_end("i1", 1))
        client = create_app(hub).test_client()
        r = client.get(f"/api/runs/{RUN}/report.html", headers={"Host": "localhost"})
        assert r.status_code == 200
        check(data_of(r.get_data(as_text=True)))
    finally:
        b.close()
