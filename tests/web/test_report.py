"""report.html and ``rankboard export`` (PROTOCOL 4 and 6, contract v3): the file built from
the dashboard's own modules, with no outbound reference and no way for a rank's string to
become markup; the route through a real broker and a real ``rankboard web``; the command as
a real subprocess against a journal, with the broker stopped, with one running on the same
data dir (nothing on disk changes, the LOCK stays the broker's), with a torn tail, and its
error cases (exit 1, one line, no file)."""
from __future__ import annotations

import base64
import hashlib
import html.parser
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from broker.journal.datadir import JournalError, take_lock
from rank_agent import protocol
from rankboard.export import report_of_sink
from tests.support.brokers import Broker, Pusher
from tests.support.http import fetch, get_json
from tests.support.polling import wait_for
from tests.support.procs import start_web
from tests.support.reportrun import HOSTILE, HOSTILE_METRIC, build_run, host_of
from web import report as rpt

REPO = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------ parsing a report
class _Page(html.parser.HTMLParser):
    """Every element's attributes, and the text of each <script> and <style>."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.scripts: list[tuple[dict[str, str | None], str]] = []
        self.styles: list[str] = []
        self._in: tuple[str, dict[str, str | None]] | None = None
        self._text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))
        if tag in ("script", "style"):
            self._in, self._text = (tag, dict(attrs)), []

    def handle_data(self, data: str) -> None:
        if self._in is not None:
            self._text.append(data)

    def handle_endtag(self, tag: str) -> None:
        if self._in is not None and tag == self._in[0]:
            text = "".join(self._text)
            if tag == "script":
                self.scripts.append((self._in[1], text))
            else:
                self.styles.append(text)
            self._in = None


def parse(text: str) -> _Page:
    page = _Page()
    page.feed(text)
    page.close()
    return page


def data_of(text: str) -> dict[str, Any]:
    page = parse(text)
    (body,) = [t for a, t in page.scripts if a.get("id") == "rankboard-data"]
    out: dict[str, Any] = json.loads(body)
    return out


def sha(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


@pytest.fixture(scope="module")
def hostile_text() -> str:
    return "".join(rpt.render(report_of_sink(build_run(None, "hostile:run", ranks=8, epochs=4,
                                                        steps=5000))))


# ------------------------------------------------------------------ the file
def test_no_outbound_reference_and_a_strict_csp(hostile_text: str) -> None:
    page = parse(hostile_text)
    refs = [(tag, k, v) for tag, attrs in page.tags for k, v in attrs.items()
            if k in ("src", "href", "srcset", "action", "data", "poster", "xlink:href")]
    assert refs, "the parser found no src/href at all"
    for tag, k, v in refs:
        assert v is not None and (v.startswith("data:") or v.startswith("#")), (tag, k, v)
    assert not re.search(r"url\(\s*['\"]?(?!data:|#)", "".join(page.styles))
    metas = [a for t, a in page.tags if t == "meta" and
             (a.get("http-equiv") or "").lower() == "content-security-policy"]
    assert len(metas) == 1
    csp = metas[0]["content"] or ""
    assert csp.startswith("default-src 'none';")
    (code,) = [t for a, t in page.scripts if a.get("type") == "module"]
    (style,) = page.styles
    assert f"script-src {sha(code)};" in csp
    assert f"style-src {sha(style)};" in csp
    assert "img-src data:;" in csp and "unsafe" not in csp and "connect-src" not in csp
    # two scripts in all: the data (not executed) and the page's own code
    assert [a.get("type") for a, _ in page.scripts] == ["application/json", "module"]
    assert hostile_text.lower().count("</script") == 2


def test_hostile_strings_stay_data(hostile_text: str) -> None:
    page = parse(hostile_text)
    (raw,) = [t for a, t in page.scripts if a.get("id") == "rankboard-data"]
    for bad in ("<", ">", "&", "\u2028", "\u2029"):
        assert bad not in raw, f"{bad!r} unescaped in the embedded JSON"
    data = json.loads(raw)
    snap = data["snapshot"]
    assert HOSTILE_METRIC in data["series"] and HOSTILE_METRIC in snap["step_metrics"]
    assert snap["metadata"]["model"] == HOSTILE and HOSTILE in snap["metadata"]
    assert HOSTILE in snap["hardware"]
    # the graph is a data: image only; its script survives only inside base64
    assert data["graph"].startswith("data:image/svg+xml;base64,")
    assert "__pwned=3" not in hostile_text
    assert base64.b64decode(data["graph"].split(",", 1)[1]).decode().count("__pwned=3") == 1


def test_embedded_series_are_the_steps_buckets(hostile_text: str) -> None:
    data = data_of(hostile_text)
    sink = build_run(None, "hostile:run", ranks=8, epochs=4, steps=5000)
    for name in [*sink.steps.metric_names(), "step_ms", "samples_per_s", "tokens_per_s"]:
        got = data["series"][name]
        want = json.loads(rpt.safe_json(sink.steps.series(name, None, None, 2000)))
        assert got == want, name
        assert len(got) <= rpt.REPORT_POINTS
        assert sum(b[7] for b in got) == 5000
    # the one-step spike at 777 is kept exactly at N = 2000 (lo/hi exact)
    assert max(b[4] for b in data["series"]["loss"]) == 50.0
    assert data["last"]["loss"][0] == data["last"]["loss"][1] == 4999
    # every rank, every record, with its host
    hosts = {r["rank"]: r["host"] for r in data["snapshot"]["ranks"]}
    assert hosts == {r: host_of(r) for r in range(8)}
    assert [r["epoch"] for r in data["snapshot"]["records"]] == [0, 1, 2, 3]
    assert data["version"] == rpt.version() and data["run"] == "hostile:run"


def test_packed_gpu_tables_round_trip() -> None:
    rows = [{"device_index": i, "name": "H100", "util": 90.0 + i / 3, "bytes": 1 << 36,
             "t": None} for i in range(16)]
    packer = rpt.Packer()
    first = packer.table("gpus", rows)
    again = packer.table("gpus", rows)
    assert first["cols"][0] == {"a": 0, "d": 1} and first["cols"][1] == {"c": "H100"}
    assert first["cols"][2] == [float(f"{90.0 + i / 3:.7g}") for i in range(16)]
    assert all(c == {"p": 1} for c in again["cols"])
    assert packer.table("gpus", rows[:3]) == rows[:3]  # small lists stay as they are


def test_bundle_links_every_module_once() -> None:
    code = rpt.bundle()
    imported = set(re.findall(r'from "\./([\w.-]+\.js)"', (rpt.STATIC / "report.js").read_text()))
    for name in imported:
        assert f"// ---- {name}\n" in code
    assert code.count("// ---- chartkit.js\n") == 1
    assert "import " not in "\n".join(ln for ln in code.splitlines()
                                      if not ln.lstrip().startswith(("//", "*")))
    assert not re.search(r"^\s*export\b", code, re.M)


@pytest.mark.parametrize("source,why", [
    ('export default function f() {}\n', "export"),
    ('import x from "./b.js";\n', "import"),
    ('const m = import("./b.js");\n', "import"),
    ('export { a };\nconst a = 1;\n', "export"),
    ('import { a } from "./cycle.js";\nexport const b = 1;\n', "cycle"),
    ('import { nope } from "./b.js";\n', "does not export"),
    ('const s = "</script>";\n', "</script"),
])
def test_bundle_refuses_what_it_cannot_link(tmp_path: Path, source: str, why: str) -> None:
    (tmp_path / "a.js").write_text(source)
    (tmp_path / "b.js").write_text("export const b = 1;\n")
    (tmp_path / "cycle.js").write_text('import { b } from "./a.js";\nexport const a = b;\n')
    with pytest.raises(rpt.BundleError, match=re.escape(why)):
        rpt.bundle("a.js", tmp_path)


def test_attachment_name() -> None:
    assert rpt.attachment_name("job:42.a") == "job_42.a.html"


# ------------------------------------------------------------------ the route
def test_route_headers_body_404_and_auth(spawn: Any, broker: Broker, pusher: Pusher) -> None:
    run = "job:7"
    for rank in range(2):
        pusher.register(run, rank, 2, host=f"node-{rank}")
    pusher.send(protocol.Metadata(run=run, rank=0, json=json.dumps({"note": HOSTILE})))
    now = time.time()
    for rank in range(2):
        pusher.send(protocol.Metrics(run=run, rank=rank, epoch=0, avg_loss=1.5, batches=10,
                                     samples=100, epoch_ms=50.0))
        pusher.send(protocol.Steps(run=run, rank=rank, steps=list(range(100)),
                                   times=[now] * 100, step_ms=[100.0] * 100,
                                   samples=[32] * 100,
                                   metrics={"loss": [1.0] * 100, HOSTILE_METRIC: [2.0] * 100}))
    pusher.send(*(protocol.Finish(run=run, rank=r) for r in range(2)))
    web = start_web(spawn, broker)
    wait_for(lambda: (get_json(web.port, f"/api/runs/{run}").get("steps_done") == 99
                      and get_json(web.port, f"/api/runs/{run}")["status"] == "complete"),
             what="the run complete with its 100 steps")
    r = fetch(web.port, f"/api/runs/{run}/report.html")
    assert r.status == 200
    assert r.headers["Content-Type"] == "text/html; charset=utf-8"
    assert r.headers["Content-Disposition"] == 'attachment; filename="job_7.html"'
    text = r.body.decode()
    csp = r.headers["Content-Security-Policy"]
    assert csp.startswith("default-src 'none';") and csp in text
    data = data_of(text)
    assert data["snapshot"]["status"] == "complete"
    assert data["snapshot"]["metadata"] == {"note": HOSTILE}
    assert [h["host"] for h in data["snapshot"]["hosts"]] == ["node-0", "node-1"]
    for metric in ("loss", HOSTILE_METRIC, "step_ms", "samples_per_s"):
        steps = get_json(web.port, f"/api/runs/{run}/steps?points=2000&metric="
                         + __import__("urllib.parse").parse.quote(metric))
        assert data["series"][metric] == steps["buckets"], metric
    assert fetch(web.port, "/api/runs/nope/report.html").status == 404
    assert fetch(web.port, f"/api/runs/{run}/report.html",
                 headers={"Host": "evil.example"}).status == 421
    guarded = start_web(spawn, broker, "--token", "s3cret")
    assert fetch(guarded.port, f"/api/runs/{run}/report.html").status == 401
    ok = fetch(guarded.port, f"/api/runs/{run}/report.html",
               headers={"Authorization": "Bearer s3cret"})
    assert ok.status == 200 and data_of(ok.body.decode())["run"] == run


# ------------------------------------------------------------------ rankboard export
def export(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "rankboard", "export", *args], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=60,
                          preexec_fn=lambda: os.umask(0o022))


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


def test_export_after_the_broker_stopped(tmp_path: Path) -> None:
    data = tmp_path / "data"
    build_run(data, "done:run", ranks=8, epochs=3, steps=3000)
    before = tree(data)
    out = tmp_path / "out"
    out.mkdir()
    got = export("done:run", "--data-dir", str(data), cwd=out)
    assert got.returncode == 0, got.stderr
    assert tree(data) == before, "export changed the data dir"
    text = (out / "done_run.html").read_text()
    d = data_of(text)
    assert d["snapshot"]["status"] == "complete" and len(d["snapshot"]["records"]) == 3
    assert sum(b[7] for b in d["series"]["loss"]) == 3000
    assert [f.name for f in out.iterdir()] == ["done_run.html"]
    assert (out / "done_run.html").stat().st_mode & 0o044, "not readable by others (umask 022)"
    named = export("done:run", "-o", str(tmp_path / "x.html"), "--data-dir", str(data), cwd=out)
    assert named.returncode == 0 and (tmp_path / "x.html").read_text().startswith("<!doctype html>")


def test_export_while_a_broker_runs(tmp_path: Path) -> None:
    data = tmp_path / "data"
    build_run(data, "live", ranks=4, epochs=2, steps=1000, finish=False)
    broker = Broker(data)
    try:
        pusher = Pusher(broker.ingest)
        try:
            before = tree(data)
            got = export("live", "-o", str(tmp_path / "a.html"), "--data-dir", str(data),
                         cwd=tmp_path)
            assert got.returncode == 0, got.stderr
            assert tree(data) == before, "export changed a live broker's files"
            with pytest.raises(JournalError):  # the LOCK is still the broker's alone
                os.close(take_lock(str(data)))
            assert data_of((tmp_path / "a.html").read_text())["snapshot"]["status"] == "training"
            # what the live broker appends is what the next export reads
            pusher.send(protocol.Metadata(run="live", rank=0, json='{"phase": "two"}'))

            def sees_it() -> bool:
                r = export("live", "-o", str(tmp_path / "b.html"), "--data-dir", str(data),
                           cwd=tmp_path)
                return r.returncode == 0 and data_of((tmp_path / "b.html").read_text())[
                    "snapshot"]["metadata"] == {"phase": "two"}
            wait_for(sees_it, 30.0, what="export reading the broker's latest frame")
        finally:
            pusher.close()
    finally:
        broker.stop()


def test_export_reads_a_torn_tail_and_leaves_it(tmp_path: Path) -> None:
    data = tmp_path / "data"
    build_run(data, "torn", ranks=4, epochs=2, steps=500)
    path = data / "runs" / "torn.journal"
    with open(path, "ab") as fh:
        fh.write(b"\x40\x00\x00\x00\x12\x34\x56\x78half an entr")
    before = tree(data)
    got = export("torn", "-o", str(tmp_path / "t.html"), "--data-dir", str(data), cwd=tmp_path)
    assert got.returncode == 0, got.stderr
    assert tree(data) == before
    assert len(data_of((tmp_path / "t.html").read_text())["snapshot"]["records"]) == 2


def test_export_errors_are_one_line_and_no_file(tmp_path: Path) -> None:
    data = tmp_path / "data"
    build_run(data, "there", ranks=2, epochs=1, steps=10)
    out = tmp_path / "out"
    out.mkdir()
    cases = [(("ghost", "--data-dir", str(data)), "ghost"),
             (("there", "--data-dir", str(tmp_path / "empty")), str(tmp_path / "empty")),
             (("../x", "--data-dir", str(data)), "../x")]
    (tmp_path / "empty").mkdir()
    for args, named in cases:
        got = export(*args, cwd=out)
        assert got.returncode == 1, (args, got.stderr)
        lines = got.stderr.strip().splitlines()
        assert len(lines) == 1 and named in lines[0] and "Traceback" not in got.stderr, lines
        assert list(out.iterdir()) == [], "a file was written"
    assert list((tmp_path / "empty").iterdir()) == [], "export wrote into the empty dir"
    shutil.rmtree(out)


def test_an_exported_run_carries_its_stack_dumps_grouped() -> None:
    """A run with stall dumps: the report of the rebuilt sink (``rankboard export``'s path)
    embeds the dumps and their groups in ``GET .../stacks``'s shape."""
    from broker.run.sink import RunSink
    from rank_agent.protocol import Register, StackFrame, Stacks, ThreadStack
    from rankboard.export import report_of_sink

    sink = RunSink("hang")
    for rank in range(3):
        sink.apply(Register(run="hang", rank=rank, world_size=3, host=f"h{rank}"), 1.0)
        where = "all_reduce" if rank else "__next__"
        frames = [StackFrame(file="train.py", line=10, function="train_step"),
                  StackFrame(file="dist.py", line=99, function=where)]
        sink.apply(Stacks(run="hang", rank=rank, reason="stall", taken_at=2.0, idle_s=90.0,
                          threads=[ThreadStack(name="MainThread", main=True, frames=frames)]),
                   2.0)
    stacks = report_of_sink(sink).stacks
    assert [d["rank"] for d in stacks["dumps"]] == [0, 1, 2]
    groups = [(g["ranks"], g["frames"][-1]["function"]) for g in stacks["groups"]]
    assert groups == [([1, 2], "all_reduce"), ([0], "__next__")]


def test_a_report_embeds_at_most_the_stacks_bound() -> None:
    """Issue 32 (Low): a run with maximal dumps made a 63 MiB report; the groups (what the
    report shows) come first, then the dumps, within MAX_REPORT_STACKS_BYTES."""
    from web.report import MAX_REPORT_STACKS_BYTES, _stacks
    frame = {"file": "/job/" + "p" * 200 + ".py", "line": 1, "function": "f", "code": "x"}
    dumps = [{"rank": r, "threads": [{"name": "MainThread", "main": True,
                                      "frames": [frame] * 100}]} for r in range(2000)]
    groups = [{"reason": "stall", "request_id": "", "frames": [frame] * 100, "ranks": [r]}
              for r in range(2000)]
    out = _stacks({"dumps": dumps, "groups": groups})
    import json as _json
    assert len(_json.dumps(out, separators=(",", ":"))) <= MAX_REPORT_STACKS_BYTES + 4096
    assert out["groups"] and out["groups_left_out"] == 2000 - len(out["groups"])
    assert out["dumps_left_out"] == 2000 - len(out["dumps"])
    small = _stacks({"dumps": dumps[:2], "groups": groups[:1]})
    assert small == {"dumps": dumps[:2], "groups": groups[:1]}
