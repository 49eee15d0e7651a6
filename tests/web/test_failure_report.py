"""The first failure (PROTOCOL 8.2, 8.5) in ``report.html`` and ``rankboard export``: the
report's embedded header carries ``failure`` as the live page has it, and the exported file
(a real ``rankboard export`` subprocess reading a journal) carries it as well, its hostile
message kept as data."""
from __future__ import annotations

import time
from pathlib import Path

from rank_agent.protocol import ErrorInfo, StackFrame
from tests.support.reportrun import build_run
from tests.web.test_report import data_of, export

HOSTILE_MESSAGE = '</script><img src=x onerror="window.__pwned=1">\nsecond line'


def errors(t: float) -> dict[int, ErrorInfo]:
    frames = [StackFrame(file="train.py", line=40, function="main", code="train()"),
              StackFrame(file="train.py", line=12, function="step", code="loss.backward()")]
    return {
        5: ErrorInfo(type="torch.OutOfMemoryError", message="CUDA out of memory. Tried 2 GiB",
                     at=t - 30.0, frames=frames),
        6: ErrorInfo(type="torch.distributed.DistBackendError", message=HOSTILE_MESSAGE,
                     at=t - 20.0),
        7: ErrorInfo(type="torch.distributed.DistBackendError", message="peer 5 gone",
                     at=t - 10.0),
    }


def test_export_carries_the_failure(tmp_path: Path) -> None:
    data = tmp_path / "data"
    t0 = time.time() - 4000.0
    sink = build_run(data, "died:run", ranks=8, epochs=2, steps=100, t0=t0,
                     errors=errors(t0 + 130.0))
    live = sink.header()["failure"]
    assert live is not None and live["first"]["rank"] == 5
    got = export("died:run", "-o", str(tmp_path / "d.html"), "--data-dir", str(data),
                 cwd=tmp_path)
    assert got.returncode == 0, got.stderr
    text = (tmp_path / "d.html").read_text()
    snap = data_of(text)["snapshot"]
    assert snap["status"] == "failed"
    assert snap["failure"] == live
    assert [g["type"] for g in snap["failure"]["groups"]] == [
        "torch.OutOfMemoryError", "torch.distributed.DistBackendError"]
    assert [r["error"]["type"] if r["error"] else None for r in snap["ranks"]] == [
        None] * 5 + ["torch.OutOfMemoryError"] + ["torch.distributed.DistBackendError"] * 2
    assert "<img src=x" not in text  # the hostile message is escaped data, not markup
