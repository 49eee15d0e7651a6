"""The demo's simulated Flight Recorder gives a dump the agent reads as it reads torch's
(``rank_agent.flightrec.collectives_frame``): the numbers as strings, the default group's
size from ``pg_config``, and the hung rank one collective behind the others."""
from __future__ import annotations

from rank_agent.flightrec import collectives_frame
from rankboard.demofr import KEPT, SimulatedRecorder


def test_a_waiting_rank_and_the_hung_rank() -> None:
    waiting, hung = SimulatedRecorder(8), SimulatedRecorder(8)
    for seq in range(1, 41):
        for rec in (waiting, hung):
            rec.enter(seq)
            rec.complete(seq)
    waiting.enter(41)  # the others reached step 40's all-reduce; the hung rank did not
    dump = waiting.read()
    assert dump["pg_status"]["0"]["last_enqueued_collective"] == "41"  # strings, as torch's
    w = collectives_frame(dump, "run", 0, "stall")
    h = collectives_frame(hung.read(), "run", 3, "stall")
    assert w is not None and h is not None
    [gw], [gh] = w.groups, h.groups
    assert (gw.pg, gw.desc, gw.size, gw.last_enqueued, gw.last_completed) == ("0", "default_pg", 8, 41, 40)
    assert (gh.last_enqueued, gh.last_completed) == (40, 40)
    assert [e.seq for e in w.entries] == list(range(41 - KEPT + 1, 42))
    assert w.entries[-1].op == "nccl:all_reduce" and not w.entries[-1].retired
    assert w.entries[-2].retired and w.entries[-1].input_sizes == [[13_107_200]]


def test_the_round_interval_is_one_figure_in_the_log_readme_and_guide() -> None:
    """Issue 43 item 7: the demo's round interval was given three ways (README "about every
    minute", the log "43 s", the runs themselves 51 s and 69 s). The log prints
    ``Cluster.round_seconds``; README and GUIDE must give the same figures for the defaults."""
    from rankboard.demo import Cluster
    from tests.support import REPO

    c = Cluster("tcp://127.0.0.1:1", ranks=8, hosts=2, epochs=20, epoch_seconds=2.0, port=0)
    epochs, steps = round(c.round_seconds("epochs")), round(c.round_seconds("steps"))
    assert (epochs, steps) == (50, 77)  # the demo's defaults
    for doc in ("README.md", "docs/GUIDE.md"):
        text = " ".join((REPO / doc).read_text(encoding="utf-8").split())
        assert f"epoch job about every {epochs} s" in text, doc
        assert f"about every {steps} s" in text, doc
