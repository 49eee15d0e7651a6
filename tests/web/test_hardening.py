"""Issue 19's web findings without sockets: SSE queues bounded by bytes (finding 7),
``drop_run`` (finding 5, web side), the ``Host`` check (finding 9), ``no-store``, CSV formula
neutralising, ambiguous request framing, the dashboard URL of another loopback address,
``--token-file``, ``--allowed-host`` and a child that dies with its parent.

The socket-level ones are in ``tests/reliability/test_web_hostile.py`` (request heads
over a real connection) and ``tests/web/test_up_owns_broker.py`` (``up`` SIGKILLed)."""
from __future__ import annotations

import csv
import io
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest

from rankboard import cli
from rankboard.config import from_args
from rankboard.process import PARENT_ENV, die_with_parent
from tests.support.polling import wait_for
from tests.web.test_hub import RUN, drain, ev, hb, header, ready_hub, record
from tests.web.test_hub_steps import steps_data
from web.app import create_app, history_csv, host_name, steps_csv_header, text_cell
from web.config import WebConfig
from web.httpguard import framing_problem
from web.hub import Hub
from web.metrics import make_registry
from web.runstate import MAX_QUEUED_BYTES, Subscriber
from web.serve import allowed_hosts, dashboard_lines
from web.stream import client_stream


def read(sub: Subscriber) -> list[Any]:
    """What a reading client takes out of its queue now (its bytes given back, as the
    stream does)."""
    items = drain(sub)
    for item in items:
        if item is not None:
            sub.taken(item)
    return items


def limited(hub: Hub, reason: str) -> float:
    """``rankboard_web_limited_total{reason=...}`` as /metrics shows it (0 when absent)."""
    for line in generate_latest(make_registry(hub)).decode().splitlines():
        if line.startswith(f'rankboard_web_limited_total{{reason="{reason}"}} '):
            return float(line.split()[-1])
    return 0.0


# ------------------------------------------------------- finding 7: bytes, not events
def test_a_non_reading_client_is_dropped_at_the_byte_bound_not_after_256_events() -> None:
    """A 65,536-rank run's ``ranks`` event is ~17 MB: 256 of them queued for one client that
    never reads was 4 GB. At the default bounds the client goes once its queue would pass
    MAX_QUEUED_BYTES, long before 256 events; a reading client of the same run stays."""
    hub = ready_hub()
    slow = hub.subscribe(RUN, 0)[0]  # type: ignore[index]
    fast = hub.subscribe(RUN, 0)[0]  # type: ignore[index]
    big = [{"rank": i, "host": "h" * 200, "status": "ok"} for i in range(20_000)]  # ~5 MB
    size = 0
    seq = 2
    while not slow.dropped:
        assert seq < 40, "never dropped: the queue is bounded by count only"
        hub.handle_pub(ev(seq, "ranks", big))
        size = len(read(fast)[0][1])
        seq += 1
    assert size > 4_000_000
    sent = seq - 2  # events offered to the slow client, the last one refused
    assert sent == MAX_QUEUED_BYTES // size + 1
    assert slow.queued_bytes == 0 and drain(slow) == [None]
    assert not fast.dropped and fast.queued_bytes == 0
    assert hub.clients_dropped == 1
    assert limited(hub, "sse_queue_bytes") == 1
    assert hub.runs[RUN].subscribers == {fast}


def test_queued_bytes_are_given_back_as_the_client_reads() -> None:
    sub = Subscriber(RUN, 10, max_bytes=100)
    assert sub.offer((1, b"x" * 60))
    assert not sub.offer((2, b"y" * 60)) and sub.full == "queue_bytes"
    item = sub.queue.get_nowait()
    sub.taken(item)
    assert sub.queued_bytes == 0
    assert sub.offer((2, b"y" * 60)) and sub.queued_bytes == 60


def test_the_event_count_bound_is_counted_under_its_own_reason() -> None:
    hub = ready_hub(queue_size=2)
    hub.subscribe(RUN, 0)
    for seq in range(2, 6):
        hub.handle_pub(ev(seq, "epoch", record(seq)))
    assert limited(hub, "sse_queue_events") == 1 and limited(hub, "sse_queue_bytes") == 0


# ------------------------------------------------------------- finding 5: drop_run
def test_drop_run_frees_the_run_and_ends_its_streams_cleanly() -> None:
    hub = ready_hub(3)
    state = hub.runs[RUN]
    assert len(state.records) == 3
    sub, initial, last = hub.subscribe(RUN, 0)  # type: ignore[misc]
    body = client_stream(hub, sub, initial, last, ping_interval=60.0)
    replayed = [next(body)]  # the replay is served
    assert b"retry:" in replayed[0]
    hub.handle_pub(ev(5, "epoch", record(3)))
    assert hub.drop_run(RUN)
    assert RUN not in hub.runs and not state.subscribers
    rest = list(body)  # ends (StopIteration) rather than waiting for more
    assert all(b"event: epoch" not in chunk or b"id: 5" not in chunk for chunk in rest)
    assert hub.client_count == 0
    assert not hub.drop_run(RUN)  # unknown: nothing to do
    # the app answers 404 for it now, as for any unknown run
    client = create_app(hub).test_client()
    assert client.get(f"/api/runs/{RUN}").status_code == 404
    assert client.get(f"/api/runs/{RUN}/events").status_code == 404
    assert client.get("/api/runs").get_json() == []


def test_drop_run_forgets_a_pending_snapshot_request_and_buffered_updates() -> None:
    hub = ready_hub(1)
    hub.handle_pub(ev(9, "epoch", record(5)))  # a gap: buffered, its snapshot wanted
    assert RUN in hub._run_buffers and RUN in hub._want_runs
    hub.drop_run(RUN)
    assert RUN not in hub._run_buffers and RUN not in hub._want_runs
    assert hub.next_request() is None


def test_drop_run_forgets_updates_buffered_during_a_full_snapshot() -> None:
    hub = ready_hub(1)
    hub.handle_pub(hb("i2"))  # a broker restart: a full snapshot is asked, updates buffered
    assert hub.next_request() == [b"SNAP"]
    hub.handle_pub(ev(3, "epoch", record(1)))
    hub.handle_pub(ev(3, "epoch", record(0), run="other"))
    hub.drop_run(RUN)
    assert [u.run for u in hub._full_buffer] == ["other"]


def test_a_dropped_run_comes_back_with_its_next_frame() -> None:
    hub = ready_hub(1)
    hub.drop_run(RUN)
    hub.handle_pub(ev(7, "run", header()))  # seq 7 after nothing: a gap, healed by snapshot
    assert hub.next_request() == [b"SNAP", RUN.encode()]


# ------------------------------------------------------- finding 9: the Host check
def tokenless_client(extra: tuple[str, ...] = ()) -> tuple[Any, Hub]:
    hub = ready_hub(1)
    app = create_app(hub, {"allowed_hosts": allowed_hosts("127.0.0.1", extra)})
    return app.test_client(), hub


@pytest.mark.parametrize("host", ["localhost", "localhost:8585", "127.0.0.1:1", "[::1]:9",
                                  "LOCALHOST", "[::1]"])
def test_a_tokenless_web_answers_its_own_host_names(host: str) -> None:
    client, _ = tokenless_client()
    assert client.get("/api/runs", headers={"Host": host}).status_code == 200


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8585", "127.0.0.1.evil.example",
                                  "localhost.evil.example", "localhost:x", "[::1", ""])
def test_any_other_host_is_421_and_counted(host: str) -> None:
    client, hub = tokenless_client()
    for path in ("/", "/api/runs", f"/api/runs/{RUN}", f"/api/runs/{RUN}/events", "/metrics"):
        got = client.get(path, headers={"Host": host})
        assert got.status_code == 421, (path, host)
    assert limited(hub, "host") == 5
    assert client.get("/healthz", headers={"Host": host}).status_code == 200  # probes


def test_no_host_header_is_421() -> None:
    client, _ = tokenless_client()
    environ = {"HTTP_HOST": ""}
    assert client.get("/api/runs", environ_overrides=environ).status_code == 421


def test_allowed_host_and_the_bound_address_are_answered() -> None:
    client, _ = tokenless_client(("dash.example.org",))
    assert client.get("/api/runs", headers={"Host": "dash.example.org:443"}).status_code == 200
    assert client.get("/api/runs", headers={"Host": "other.example.org"}).status_code == 421
    hosts = allowed_hosts("::1", ["Proxy.Example"])
    assert {"[::1]", "proxy.example", "localhost", "127.0.0.1"} <= hosts
    assert "10.0.0.5" in allowed_hosts("10.0.0.5")


def test_a_web_with_a_token_checks_the_token_not_the_host() -> None:
    hub = ready_hub(1)
    client = create_app(hub, {"token": "s3cret"}).test_client()
    headers = {"Host": "dash.example.org", "Authorization": "Bearer s3cret"}
    assert client.get("/api/runs", headers=headers).status_code == 200
    assert client.get("/api/runs", headers={"Host": "dash.example.org"}).status_code == 401


def test_host_name_parsing() -> None:
    assert host_name("LocalHost:80") == "localhost"
    assert host_name("[::1]:8585") == "[::1]"
    assert host_name("127.0.0.2") == "127.0.0.2"
    assert host_name(None) is None and host_name("a:b") is None and host_name("[::1]x") is None


# --------------------------------------------------------------------- no-store
def test_api_and_metrics_answers_are_no_store() -> None:
    client, _ = tokenless_client()
    for path in ("/api/runs", f"/api/runs/{RUN}", f"/api/runs/{RUN}/history",
                 f"/api/runs/{RUN}/history.csv", f"/api/runs/{RUN}/steps.csv",
                 f"/api/runs/{RUN}/steps?metric=loss", "/api/runs/nope", "/metrics"):
        got = client.get(path)
        assert got.headers.get("Cache-Control") == "no-store", path
    assert client.get("/").headers.get("Cache-Control") != "no-store"


# ------------------------------------------------------------------------- CSV
HOSTILE = ["=HYPERLINK(\"http://x\")", "+1+1", "-2+3", "@SUM(A1)", "\tx", "\rx"]


def test_text_cell_neutralises_each_formula_start() -> None:
    for name in HOSTILE:
        assert text_cell(name) == "'" + name
    assert text_cell("loss") == "loss" and text_cell("a=b") == "a=b"


def test_history_csv_header_is_neutralised_and_numbers_stay_numbers() -> None:
    rec = record(0, loss=-0.5)
    rec["metrics"] = {"loss": -0.5, **{name: -1.25 for name in HOSTILE}}
    rows = list(csv.reader(io.StringIO(history_csv([rec]))))
    for cell in rows[0]:
        assert not cell.startswith(("=", "+", "-", "@", "\t", "\r")), cell
    assert "'=HYPERLINK(\"http://x\")" in rows[0]
    assert rows[1][2] == "-0.5" and rows[1][3] == "-1.25"  # negative numbers untouched


def step(n: int, metrics: dict[str, Any]) -> dict[str, Any]:
    return {"step": n, "time": 1.0, "n": 1, "metrics": metrics, "step_ms": [5.0, 5.0, 5.0],
            "slowest_rank": 0, "samples": 1, "tokens": 1}


def test_steps_csv_header_is_neutralised() -> None:
    hub = ready_hub(1)
    hub.handle_pub(ev(3, "steps", steps_data([
        step(0, {name: [-1.0, -2.0, 0.0] for name in HOSTILE})])))
    body = create_app(hub).test_client().get(f"/api/runs/{RUN}/steps.csv").get_data(
        as_text=True)
    rows = list(csv.reader(io.StringIO(body)))
    for cell in rows[0]:
        assert not cell.startswith(("=", "+", "-", "@", "\t", "\r")), cell
    assert "'@SUM(A1)_mean" in rows[0]
    assert "-1.0" in rows[1]
    assert steps_csv_header(["loss"]).startswith("step,time,n,loss_mean,loss_min,loss_max,")


# ------------------------------------------------------------------- framing (unit)
@pytest.mark.parametrize("lines,problem", [
    (["Content-Length: 3", "Transfer-Encoding: chunked"], "both"),
    (["Content-Length: 3", "Content-Length: 3"], "more than one"),
    (["Content-Length: +3"], "not a decimal"),
    (["Content-Length: 0x3"], "not a decimal"),
    (["X-A: 1", " folded"], "folding"),
    (["X-A: 1", "\tfolded"], "folding"),
    (["Transfer-Encoding: gzip, chunked"], "Transfer-Encoding"),
    (["Transfer-Encoding: chunked", "Transfer-Encoding: chunked"], "Transfer-Encoding"),
    (["no colon here"], "malformed"),
])
def test_ambiguous_framing_is_named(lines: list[str], problem: str) -> None:
    found = framing_problem(lines)
    assert found is not None and problem in found


def test_plain_framing_passes() -> None:
    assert framing_problem(["Host: x", "Content-Length: 12"]) is None
    assert framing_problem(["Host: x", "Transfer-Encoding: Chunked"]) is None
    assert framing_problem([]) is None


# ------------------------------------------------------------ the dashboard URL
def test_another_loopback_address_is_printed_as_bound() -> None:
    lines = dashboard_lines("127.0.0.2", 8585)
    assert lines[0] == "dashboard: http://127.0.0.2:8585"
    assert lines[1].startswith("ssh -L 8585:127.0.0.2:8585 ")
    assert dashboard_lines("127.0.0.1", 1)[0] == "dashboard: http://localhost:1"
    assert dashboard_lines("::1", 2)[0] == "dashboard: http://[::1]:2"
    assert dashboard_lines("10.1.2.3", 3) == ["dashboard: http://10.1.2.3:3"]


# ------------------------------------------------------------ --token-file, --allowed-host
def parse(*argv: str) -> Any:
    args = cli.build_parser().parse_args(list(argv))
    problem = cli._read_token_file(args)
    assert problem is None, problem
    return from_args(args)


def test_token_file_is_read_and_reaches_workers_by_environment(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("  tok-123  \n")
    cfg = parse("web", "--token-file", str(path), "--token", "other", "--workers", "2")
    assert isinstance(cfg, WebConfig) and cfg.token == "tok-123"
    worker = cfg.worker(1, 8585)
    assert "tok-123" not in " ".join(worker.argv())
    assert worker.env({})["RANKBOARD_TOKEN"] == "tok-123"


@pytest.mark.parametrize("content", [None, "", "\n\n", "x" * 5000])
def test_a_bad_token_file_is_one_line_and_status_2(tmp_path: Path, content: str | None,
                                                   capsys: Any) -> None:
    path = tmp_path / "token"
    if content is not None:
        path.write_text(content)
    assert cli.main(["web", "--token-file", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rankboard web: ") and "--token-file" in err and "\n" not in err


def test_allowed_host_is_repeatable_and_passed_to_workers() -> None:
    cfg = parse("up", "--allowed-host", "a.example", "--allowed-host", "b.example")
    assert cfg.web.allowed_hosts == ("a.example", "b.example")
    argv = cfg.web.worker(1, 8585).argv()
    assert argv.count("--allowed-host") == 2 and "b.example" in argv


# ------------------------------------------------------------ a child dies with its parent
def test_die_with_parent_ignores_a_stale_or_missing_owner() -> None:
    assert not die_with_parent({})
    env = {PARENT_ENV: "nope"}
    assert not die_with_parent(env) and PARENT_ENV not in env


def _orphan_ends(child_code: str, stderr_fd: int = -1) -> None:
    """A middle process starts a child running ``child_code`` (which arms die_with_parent
    and prints ``armed``), then is SIGKILLed: the orphaned child must end within 10 s.
    ``stderr_fd``: the child's stderr (passed down through the middle)."""
    middle_code = (
        "import os, subprocess, sys, time\n"
        f"env = dict(os.environ, {PARENT_ENV}=str(os.getpid()))\n"
        "fd = int(sys.argv[3])\n"
        "p = subprocess.Popen([sys.executable, '-c', sys.argv[1], sys.argv[2]], env=env,"
        " stdout=subprocess.PIPE, text=True, stderr=fd if fd >= 0 else None,"
        " pass_fds=(fd,) if fd >= 0 else ())\n"
        "assert p.stdout.readline().strip() == 'armed'\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(60)\n")
    repo = str(Path(__file__).resolve().parents[2])
    middle = subprocess.Popen([sys.executable, "-c", middle_code, child_code, repo,
                               str(stderr_fd)], stdout=subprocess.PIPE, text=True,
                              pass_fds=(stderr_fd,) if stderr_fd >= 0 else ())
    if stderr_fd >= 0:
        os.close(stderr_fd)  # the child holds the only write end now
    child = 0
    try:
        assert middle.stdout is not None
        child = int(middle.stdout.readline())
        middle.kill()
        middle.wait(10)

        def gone() -> bool:
            try:
                os.kill(child, 0)
            except ProcessLookupError:
                return True
            with open(f"/proc/{child}/stat") as fh:  # reparented but not reaped yet
                return fh.read().split(")")[-1].split()[0] == "Z"

        wait_for(gone, timeout=10, what="the orphaned child to end")
    finally:
        if middle.poll() is None:
            middle.kill()
            middle.wait(10)
        if middle.stdout is not None:
            middle.stdout.close()
        if child:
            try:
                os.kill(child, signal.SIGKILL)  # a failure must not leave the orphan behind
            except ProcessLookupError:
                pass


def test_a_child_whose_owner_is_killed_ends() -> None:
    """The child ends on the kernel's SIGTERM instead of living on as an orphan."""
    _orphan_ends("import sys, time; sys.path.insert(0, sys.argv[1]); "
                 "from rankboard.process import die_with_parent; "
                 "assert die_with_parent(); print('armed', flush=True); time.sleep(60)")


def test_a_child_whose_clean_stop_hangs_still_ends() -> None:
    """A SIGTERM only asks: a child whose stop never finishes (here it ignores SIGTERM) is
    ended by the parent watch after PARENT_GRACE, so no orphan keeps the ports and lock."""
    _orphan_ends("import signal, sys, time; sys.path.insert(0, sys.argv[1]); "
                 "import rankboard.process as p; p.PARENT_POLL = 0.05; p.PARENT_GRACE = 0.5; "
                 "signal.signal(signal.SIGTERM, lambda *_: None); "
                 "assert p.die_with_parent(); print('armed', flush=True); time.sleep(60)")


def test_a_child_wedged_writing_to_its_stderr_still_ends() -> None:
    """The stop can be wedged on stderr itself: a pipe that is full and that nobody reads
    (here the test holds the read end open and never reads it). The main thread then
    blocks in a write while holding the stream's lock, so the watch must not write its last
    line through ``sys.stderr``."""
    read_end, write_end = os.pipe()
    try:
        _orphan_ends("import signal, sys, time; sys.path.insert(0, sys.argv[1]); "
                     "import rankboard.process as p; p.PARENT_POLL = 0.05; "
                     "p.PARENT_GRACE = 0.5; signal.signal(signal.SIGTERM, lambda *_: None); "
                     "assert p.die_with_parent(); print('armed', flush=True)\n"
                     "while True: sys.stderr.write('x' * 65536)", stderr_fd=write_end)
    finally:
        os.close(read_end)
