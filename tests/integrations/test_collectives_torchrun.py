"""The collective verdict for real (PROTOCOL.md section 7.2): torchrun with three gloo ranks
on CPU (tests/integrations/collective_child.py), each with a ``RankAgent`` whose stall watch
reads torch's Flight Recorder beside its dumps, reporting to a real broker; one rank does
something else while the others wait in ``all_reduce``, and the broker's verdict names it:

* it stops before the collective (asleep in Python): ``behind``, the others ``waiting``;
* it enters another collective (``broadcast``) at the same sequence number: ``mismatched``;
* it is gone without a word (stopped): ``absent`` from group 0, the others ``waiting``.

The web (a real ``rankboard web`` process) serves the same verdict at ``GET
/api/runs/<run>/collectives``, and the header lists the alerts.
"""
from __future__ import annotations

import os
import signal
import subprocess
import uuid
from typing import Any, Dict, Iterator, List, Optional

import psutil
import pytest

from tests.support import polling
from tests.support.integrations import REPO, example_env, torchrun

CHILD = str(REPO / "tests" / "integrations" / "collective_child.py")
WAIT = 90.0


class Job:
    """A torchrun job of the child; ended with SIGKILL to it and each of its descendants
    (torchrun starts its workers in sessions of their own, and a stopped rank would never
    act on a SIGTERM)."""

    def __init__(self, broker: Any, case: str) -> None:
        self.run = f"coll-{case}-{uuid.uuid4().hex[:8]}"
        self._out = ""
        env = example_env(broker, RANKBOARD_RUN=self.run, COLLECTIVE_CASE=case,
                          COLLECTIVE_ODD="2")
        self.proc = subprocess.Popen([*torchrun(3), CHILD], cwd=REPO, env=env,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)

    def output(self) -> str:
        if self.proc.returncode is not None:
            return self._out
        try:
            family = [*psutil.Process(self.proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            family = []
        for p in [*family, self.proc]:
            try:
                os.kill(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        out, _ = self.proc.communicate(timeout=30)
        self._out = out or ""
        return self._out


@pytest.fixture
def jobs() -> Iterator[List[Job]]:
    started: List[Job] = []
    yield started
    for job in started:
        if job.proc.returncode is None:
            job.output()


def verdict(broker: Any, job: Job, ready: Any) -> Dict[str, Any]:
    """The broker's group 0 once ``ready(group)`` holds (the job's output on failure)."""
    def group() -> Optional[Dict[str, Any]]:
        if job.proc.poll() is not None:
            raise AssertionError(f"the job ended ({job.proc.returncode}):\n{job.output()[-6000:]}")
        if job.run not in broker.runs():
            return None
        groups = broker.snapshot(job.run)["collectives"]["groups"]
        found = [g for g in groups if g["pg"] == "0"]
        return found[0] if found and ready(found[0]) else None

    try:
        return polling.wait_for(group, WAIT, "the collective verdict", interval=0.2)
    except AssertionError:
        print(job.output()[-6000:])
        raise


def test_a_rank_that_stops_before_the_collective_is_behind(broker, web, jobs) -> None:
    job = Job(broker, "behind")
    jobs.append(job)
    group = verdict(broker, job, lambda g: g["behind"] and g["waiting"] == [0, 1])
    assert group["op"] == "gloo:all_reduce" and group["desc"] == "default_pg"
    assert group["seq"] == 5  # four steps of one all_reduce each; the fifth is waited in
    assert group["behind"] == [{"rank": 2, "last_enqueued": 4, "op": "gloo:all_reduce"}]
    assert group["absent"] == [] and group["mismatched"] == []
    # what the agents sent: integers, each with its stall dump's reason
    frames = broker.frames(job.run, "collectives")
    assert {f.rank for f in frames} == {0, 1, 2} and {f.reason for f in frames} == {"stall"}
    # the web serves the broker's verdict, and the header lists the alert
    def served() -> Any:
        body = web.get(f"/api/runs/{job.run}/collectives")
        return body if body["groups"] else None

    body = polling.wait_for(served, 20.0, "GET /collectives with the verdict")
    assert body["groups"][0]["behind"][0]["rank"] == 2
    assert sorted({r["rank"] for r in body["ranks"]}) == [0, 1, 2]
    alerts = {(a["kind"], a["rank"]): a["message"]
              for a in broker.snapshot(job.run)["header"]["alerts"]}
    assert alerts[("collective_behind", 2)] == (
        "not in gloo:all_reduce #5 of group 0 where 2 ranks wait")


def test_a_rank_in_another_collective_is_mismatched(broker, jobs) -> None:
    job = Job(broker, "mismatch")
    jobs.append(job)
    group = verdict(broker, job, lambda g: g["mismatched"] and len(g["waiting"]) == 3)
    assert group["seq"] == 5 and group["op"] == "gloo:all_reduce" and group["behind"] == []
    assert group["mismatched"] == [{"rank": 2, "op": "gloo:broadcast", "input_sizes": [[4, 8]]}]
    alerts = {(a["kind"], a["rank"]): a["message"]
              for a in broker.snapshot(job.run)["header"]["alerts"]}
    assert alerts[("collective_mismatch", 2)] == (
        "gloo:all_reduce #5 of group 0 differs: gloo:broadcast [[4, 8]]")


def test_a_rank_that_is_gone_is_absent_while_the_others_wait(broker, jobs) -> None:
    job = Job(broker, "dies")
    jobs.append(job)
    group = verdict(broker, job, lambda g: g["absent"] and g["waiting"] == [0, 1])
    assert group["absent"] == [2] and group["behind"] == [] and group["seq"] == 5
    assert {f.rank for f in broker.frames(job.run, "collectives")} == {0, 1}
