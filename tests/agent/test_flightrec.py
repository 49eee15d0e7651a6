"""The agent's reading of PyTorch's Flight Recorder (PROTOCOL.md section 7.2), on dumps
captured from torch 2.13 gloo (``tests/agent/data/fr_gloo_rank*.json``: three ranks under
torchrun, a subgroup of ranks 0-1, a send/recv, and rank 2 asleep before the last
``all_reduce`` that ranks 0-1 are in), and on synthetic dumps for what gloo never writes
(point-to-point entries, the NCCL recorder, a full 2,000-entry ring, hostile values).

torch is not installed here (the agent's tox env must not have it): the process's
``sys.modules`` is given a stand-in for exactly the attributes the agent looks up. The real
thing is tests/integrations/test_collectives_torchrun.py.
"""
from __future__ import annotations

import json
import logging
import sys
import threading
import types
from pathlib import Path
from typing import Any, Dict, List

import pytest

from rank_agent import protocol
from rank_agent.control import Control
from rank_agent.flightrec import FlightRecorder, collectives_frame, read_trace
from rank_agent.protocol import Collectives, Stacks
from rank_agent.stallwatch import StallWatch
from tests.support.polling import wait_for

DATA = Path(__file__).resolve().parent / "data"


def sample(rank: int) -> Dict[str, Any]:
    return json.loads((DATA / f"fr_gloo_rank{rank}.json").read_text())


def roundtrip(frame: Collectives) -> Collectives:
    """Through the wire's decoder: the frame the broker would accept."""
    decoded = protocol.decode(protocol.encoder.encode(frame))
    assert isinstance(decoded, Collectives)
    return decoded


def test_a_gloo_dump_becomes_a_frame_with_integers_and_each_groups_entries() -> None:
    frame = roundtrip(collectives_frame(sample(0), "run", 0, "stall", "", 5.0))  # type: ignore[arg-type]
    assert [(g.pg, g.desc, g.last_enqueued, g.last_completed) for g in frame.groups] == [
        ("0", "default_pg", 6, 4), ("1", "undefined", 1, 1)]
    assert [(e.pg, e.seq) for e in frame.entries] == [
        ("0", 1), ("0", 2), ("0", 3), ("0", 4), ("0", 5), ("1", 1)]
    last = frame.entries[4]
    assert (last.op, last.input_sizes, last.state, last.retired) == (
        "gloo:all_reduce", [[4, 8]], "scheduled", False)
    assert frame.taken_at == 5.0 and frame.reason == "stall"
    behind = roundtrip(collectives_frame(sample(2), "run", 2, "request", "q1"))  # type: ignore[arg-type]
    assert [(g.pg, g.last_enqueued) for g in behind.groups] == [("0", 4)]
    assert behind.request_id == "q1" and max(e.seq for e in behind.entries) == 4


def synthetic(n: int, *, pg: str = "0", p2p_every: int = 0) -> Dict[str, Any]:
    entries = [{"collective_seq_id": i, "process_group": [pg, "default_pg"],
                "profiling_name": "nccl:all_reduce", "input_sizes": [[1024, 1024]],
                "state": "completed", "retired": True,
                "is_p2p": bool(p2p_every and i % p2p_every == 0)} for i in range(1, n + 1)]
    return {"pg_status": {pg: {"last_enqueued_collective": str(n),
                               "last_completed_collective": str(n)}},
            "pg_config": {pg: {"desc": "default_pg", "ranks": "[0, 1, 2, 3]"}},
            "entries": entries}


def test_the_newest_64_per_group_and_no_point_to_point_entry() -> None:
    frame = roundtrip(collectives_frame(synthetic(2000, p2p_every=7), "r", 0, "stall"))  # type: ignore[arg-type]
    seqs = [e.seq for e in frame.entries]
    assert len(seqs) == 64 and seqs == sorted(seqs) and seqs[-1] == 2000
    assert all(s % 7 for s in seqs)
    assert frame.groups[0].size == 4 and frame.groups[0].desc == "default_pg"


def test_hostile_values_are_cut_to_the_wire_bounds_or_left_out() -> None:
    data = synthetic(3)
    data["pg_status"].update({str(i): {"last_enqueued_collective": "x"} for i in range(1, 100)})
    data["entries"][0].update(profiling_name="p" * 1000, input_sizes=[[1] * 40] * 40,
                              state=None)
    data["entries"].append("not an entry")
    data["entries"].append({"process_group": "0", "collective_seq_id": "nan"})
    frame = roundtrip(collectives_frame(data, "r", 0, "stall"))  # type: ignore[arg-type]
    assert len(frame.groups) == 64 and frame.groups[5].last_enqueued == -1
    first = frame.entries[0]
    assert len(first.op) == 128 and len(first.input_sizes) == 16
    assert all(len(s) == 16 for s in first.input_sizes)
    assert collectives_frame({"entries": []}, "r", 0, "stall") is None


class FakeDist:
    def __init__(self, initialized: bool = True) -> None:
        self.initialized = initialized

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return self.initialized


def fake_torch(generic: Any = None, nccl: Any = None) -> Dict[str, Any]:
    c10d = types.SimpleNamespace()
    if generic is not None:
        c10d._dump_fr_trace_json = generic
    if nccl is not None:
        c10d._dump_nccl_trace_json = nccl
    torch = types.SimpleNamespace(_C=types.SimpleNamespace(_distributed_c10d=c10d))
    return {"torch": torch, "torch.distributed": FakeDist()}


def test_read_trace_prefers_nccl_when_it_holds_entries_else_the_generic_recorder() -> None:
    gloo = json.dumps(sample(0)).encode()
    calls: List[tuple] = []

    def generic(include_collectives: bool, only_active: bool) -> bytes:
        calls.append(("generic", include_collectives, only_active))
        return gloo

    nccl_full = json.dumps(synthetic(5)).encode()
    assert read_trace(fake_torch(generic, lambda *a: nccl_full))["pg_config"]["0"]  # type: ignore[index]
    assert calls == []
    empty = json.dumps({"entries": [], "pg_status": {}}).encode()
    assert read_trace(fake_torch(generic, lambda *a: empty)) == sample(0)
    assert calls == [("generic", True, False)]
    assert read_trace({}) is None  # torch never imported
    modules = fake_torch(generic)
    modules["torch.distributed"] = FakeDist(initialized=False)
    assert read_trace(modules) is None  # no default group
    assert read_trace(fake_torch()) is None  # no recorder at all


def test_errors_are_logged_once_and_never_raise(caplog: pytest.LogCaptureFixture) -> None:
    def broken() -> Any:
        raise RuntimeError("private API changed")

    sent: List[Any] = []
    reader = FlightRecorder(broken)
    stacks = Stacks(run="r", rank=1, reason="stall", taken_at=1.0)
    with caplog.at_level(logging.DEBUG, logger="rank_agent.flightrec"):
        assert not reader.send_beside(sent.append, stacks)
        assert not reader.send_beside(sent.append, stacks)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "private API changed" in warnings[0].getMessage()
    assert sent == [] and reader.failures == 2
    assert not FlightRecorder(lambda: {"pg_status": "garbage"}).send_beside(sent.append, stacks)
    assert not FlightRecorder(lambda: None).send_beside(sent.append, stacks)
    ok = FlightRecorder(lambda: sample(0))
    assert ok.send_beside(sent.append, Stacks(run="r", rank=1, reason="request",
                                              request_id="q7", taken_at=1.0))
    assert sent[0].reason == "request" and sent[0].request_id == "q7" and sent[0].rank == 1


def test_a_request_answer_is_followed_by_the_collectives_frame(
        monkeypatch: pytest.MonkeyPatch) -> None:
    gloo = json.dumps(sample(2)).encode()
    for name, module in fake_torch(lambda *a: gloo).items():
        monkeypatch.setitem(sys.modules, name, module)
    got: List[Any] = []
    control = Control("tcp://127.0.0.1:9", "r", 2, got.append)  # never started: no socket
    control._answer(Stacks(run="r", rank=2, reason="request", request_id="abc",
                           taken_at=1.0))
    assert [type(f) for f in got] == [Stacks, Collectives]
    assert (got[1].reason, got[1].request_id, got[1].rank) == ("request", "abc", 2)
    # without torch in the process: the answer alone
    monkeypatch.delitem(sys.modules, "torch")
    control._answer(Stacks(run="r", rank=2, reason="request", request_id="abd", taken_at=1.0))
    assert [type(f) for f in got] == [Stacks, Collectives, Stacks]


def test_a_stall_dump_is_followed_by_the_collectives_frame_from_the_agents_thread(
        monkeypatch: pytest.MonkeyPatch) -> None:
    threads: List[str] = []
    gloo = json.dumps(sample(1)).encode()

    def generic(*args: Any) -> bytes:
        threads.append(threading.current_thread().name)
        return gloo

    for name, module in fake_torch(generic).items():
        monkeypatch.setitem(sys.modules, name, module)
    got: List[Any] = []
    watch = StallWatch(got.append, "r", 1, 0.05)
    try:
        watch.note()
        watch.start()
        wait_for(lambda: len(got) >= 2, 10, "a dump and its collectives")
    finally:
        watch.close()
    assert isinstance(got[0], Stacks) and isinstance(got[1], Collectives)
    assert got[1].reason == "stall" and got[1].groups[0].last_enqueued == 6
    assert threads and all(name.startswith("rankboard-stallwatch") for name in threads)
