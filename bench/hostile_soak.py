"""hostile_soak: every attack of issue 19 at once against ONE ``rankboard up``, while an
honest 64-rank run streams; what the honest run saw.

    python bench/hostile_soak.py --quick     # 6 s of attacks
    python bench/hostile_soak.py             # 60 s

Processes: ``rankboard up`` (broker child + web), started on a data dir holding an older
run's journal with one byte flipped in its middle; an honest sender process (a PUSH socket
acting as 64 ranks: registers, a ``steps`` frame per rank and step, a ``metrics`` frame per
rank and epoch, paced); an attacker process (one thread per attack, each bounded in count
and in time, all stopping at the deadline); and this process, which reads the honest run's
SSE stream and samples the RSS of ``up`` and its children. Traffic goes to 127.0.0.1 only.

Attacks (sizes for the full run; ``--quick`` scales them down):

* ``hardware``: one run of world size 65,536 with 4,096 ranks registered (hosts of 8) and a
  4,096-character hardware summary with a GPU part from each, summaries then rewritten;
* ``metadata_flood``: valid 4 MiB ``metadata`` frames (1 MiB of slow JSON, each different
  from the one before, plus a 3 MiB ignored key), as fast as the broker takes them;
* ``step_names``: ``steps`` frames of 64 new 128-character metric names each, past the
  1,024-name cap;
* ``surrogate``: metadata JSON holding a lone surrogate escape;
* ``junk_runs``: never-finished runs far beyond ``--max-runs`` (100);
* ``slow_sse``: an SSE client of the wide run that never reads (4 KiB receive buffer);
* ``heads``: connections sending 60 KB of an unfinished request head, and 70 KB heads;
* ``wrong_host``: requests with a foreign ``Host``;
* ``snapshot_storm``: a DEALER asking the broker for the wide run's snapshot 60 times at a
  time without reading (the feed is open on loopback: anything local can do it);
* ``reconnect_storm``: SSE clients of the honest and wide runs connecting with a random
  ``Last-Event-ID``, reading one event, disconnecting;
* ``hostile_msgpack``: random bytes, truncated frames, deep nesting, wrong tags and types;
* ``flipped_journal``: the data dir's older run has one byte flipped before ``up`` starts.

Figures: ``hostile_soak_honest_e2e_p99_ms`` (from the honest sender's last ``metrics``
frame of an epoch to that ``epoch`` event read from the web's SSE stream), ``hostile_soak_
max_rss_mib`` (peak of ``up`` + broker + web RSS summed, sampled every 100 ms),
``hostile_soak_honest_lost`` (epochs missing from the SSE stream plus steps missing from
``/steps`` at the end). ``journal_bytes_per_noop_frame`` is bench/journal_bench.py's.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import socket
import struct
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

import msgspec
import psutil
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common  # noqa: E402

from rank_agent import protocol  # noqa: E402

#: every attack, by its method name on _Attacks
ATTACKS = ["hardware", "metadata_flood", "step_names", "surrogate", "junk_runs",
           "hostile_msgpack", "snapshot_storm", "wrong_host", "heads", "slow_sse",
           "reconnect_storm"]
HONEST = "honest"
WIDE = "hw-wide"
RANKS = 64
MAX_RUNS = 100
EPOCH_PERIOD_S = 0.5
STEPS_PER_EPOCH = 5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- the honest run ------------------------------------------------------------------------

def _honest(ingest: str, epochs: int, go: Any, out: Any) -> None:
    """64 ranks on one PUSH socket (sends wait rather than drop: nothing honest is lost on
    this side); paced at one epoch per EPOCH_PERIOD_S with STEPS_PER_EPOCH steps in it."""
    enc = protocol.encoder.encode
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.linger = 5000
    sock.sndhwm = 100_000
    sock.connect(ingest)
    for r in range(RANKS):
        sock.send(enc(protocol.Register(run=HONEST, rank=r, world_size=RANKS,
                                        host=f"honest-{r // 8}", local_rank=r % 8,
                                        total_epochs=epochs)))
        sock.send(enc(protocol.Hardware(run=HONEST, rank=r, summary=f"cpu | gpu{r % 8}")))
    go.wait(60)
    start = time.monotonic()
    step = 0
    sent: list[tuple[int, float]] = []
    for e in range(epochs):
        for _ in range(STEPS_PER_EPOCH):
            now = time.time()
            for r in range(RANKS):
                sock.send(enc(protocol.Steps(run=HONEST, rank=r, steps=[step], times=[now],
                                             step_ms=[10.0 + r % 3], samples=[64],
                                             metrics={"loss": [1.0 / (step + 1) + r * 1e-3]})))
            step += 1
        for r in range(RANKS):
            sock.send(enc(protocol.Metrics(run=HONEST, rank=r, epoch=e, avg_loss=1.0 / (e + 1),
                                           batches=10, samples=640, epoch_ms=100.0)))
        sent.append((e, time.monotonic()))
        pause = start + (e + 1) * EPOCH_PERIOD_S - time.monotonic()
        if pause > 0:
            time.sleep(pause)  # pacing, not synchronisation
    sock.close()
    ctx.term()
    out.put({"epochs": sent, "steps": step})


# -- the attacks ---------------------------------------------------------------------------

class _Attacks:
    """One thread per attack; each bounded in count and stopping at ``deadline``."""

    def __init__(self, ingest: str, snapshot: str, web: int, deadline: float, scale: float) -> None:
        self.ingest, self.snapshot, self.web = ingest, snapshot, web
        self.deadline = deadline
        self.scale = scale
        self.ctx = zmq.Context()
        self.counts: dict[str, Any] = {}
        self.lock = threading.Lock()
        self.enc = protocol.encoder.encode

    def left(self) -> bool:
        return time.monotonic() < self.deadline

    def n(self, full: int) -> int:
        return max(1, int(full * self.scale))

    def count(self, name: str, k: str = "sent", by: int = 1) -> None:
        with self.lock:
            d = self.counts.setdefault(name, {})
            d[k] = d.get(k, 0) + by

    def push(self, hwm: int = 1000) -> zmq.Socket:
        s = self.ctx.socket(zmq.PUSH)
        s.linger = 0
        s.sndhwm = hwm
        s.sndtimeo = 1000
        s.connect(self.ingest)
        return s

    def send(self, s: zmq.Socket, name: str, raw: bytes, copy: bool = True) -> bool:
        while self.left():
            try:
                s.send(raw, copy=copy)
                self.count(name)
                return True
            except zmq.Again:
                continue
        return False

    # each attack -------------------------------------------------------------------------

    def hardware(self) -> None:
        s = self.push(100_000)
        ranks = self.n(4096)
        for r in range(ranks):
            if not self.left():
                break
            self.send(s, "hardware", self.enc(protocol.Register(
                run=WIDE, rank=r, world_size=65536, host=f"hw-{r // 8:05d}", local_rank=r % 8)))
            self.send(s, "hardware", self.enc(protocol.Hardware(
                run=WIDE, rank=r, summary="Xeon " + "c" * 40 + " | " + f"H100 {r} " + "g" * 4000)))
        rng = random.Random(1)
        for i in range(self.n(100_000)):
            if not self.left():
                break
            r = rng.randrange(ranks)
            self.send(s, "hardware", self.enc(protocol.Hardware(
                run=WIDE, rank=r, summary="Xeon | " + f"H100 {r} {i} " + "g" * 4000)))
            if i % 500 == 499:
                time.sleep(0.05)  # pacing: a rewrite rate, not a flood (that is another attack)
        s.close()

    def metadata_flood(self) -> None:
        s = self.push(2)
        pool = []
        for i in range(4):
            blob = json.dumps({"i": i, "v": [0] * 349_000}, separators=(",", ":"))
            body: dict[str, Any] = {"type": "metadata", "run": "md-flood", "rank": 0, "json": blob}
            body["pad"] = "x" * (protocol.MAX_FRAME_BYTES - len(msgspec.msgpack.encode(body)) - 64)
            pool.append(msgspec.msgpack.encode(body))
        for i in range(self.n(600)):
            if not self.send(s, "metadata_flood", pool[i % 4], copy=False):
                break
        s.close()

    def step_names(self) -> None:
        s = self.push()
        for i in range(self.n(500)):
            if not self.left():
                break
            names = {f"m{i:04d}_{k:02d}_" + "n" * 119: [1.0] for k in range(64)}
            self.send(s, "step_names", self.enc(protocol.Steps(
                run="names", rank=0, steps=[i], times=[time.time()], step_ms=[1.0],
                metrics=names)))
        s.close()

    def surrogate(self) -> None:
        s = self.push()
        for i in range(self.n(200)):
            if not self.left():
                break
            self.send(s, "surrogate", self.enc(protocol.Metadata(
                run="surrogate", rank=0, json='{"path": "/data/x\\udcff", "i": ' + str(i) + "}")))
            time.sleep(0.01)
        s.close()

    def junk_runs(self) -> None:
        s = self.push()
        for i in range(self.n(3000)):
            if not self.left():
                break
            self.send(s, "junk_runs", self.enc(protocol.Register(
                run=f"junk-{i:05d}", rank=0, world_size=4, host="junk")))
            time.sleep(0.003)
        s.close()

    def hostile_msgpack(self) -> None:
        s = self.push()
        rng = random.Random(7)
        good = self.enc(protocol.Register(run="mp", rank=0, world_size=2, host="h"))
        shapes: list[Callable[[], bytes]] = [
            lambda: rng.randbytes(rng.randrange(1, 512)),
            lambda: good[: rng.randrange(1, len(good))],
            lambda: b"\x91" * 50_000 + b"\xc0",
            lambda: msgspec.msgpack.encode({"type": "nope", "run": "mp", "rank": 0}),
            lambda: msgspec.msgpack.encode({"type": "register", "run": "mp", "rank": -1,
                                            "world_size": 2, "host": "h"}),
            lambda: msgspec.msgpack.encode({"type": "metrics", "run": "mp\n", "rank": 0,
                                            "epoch": 0, "avg_loss": 1.0}),
            lambda: b"\xcf" + struct.pack(">Q", 2**64 - 1),
            lambda: msgspec.msgpack.encode({"type": "register", "run": "..", "rank": 0,
                                            "world_size": 1, "host": "h"}),
        ]
        for _ in range(self.n(20_000)):
            if not self.left():
                break
            self.send(s, "hostile_msgpack", rng.choice(shapes)())
            time.sleep(0.0005)
        s.close()

    def snapshot_storm(self) -> None:
        d = self.ctx.socket(zmq.DEALER)
        d.linger = 0
        d.rcvhwm = 1
        d.sndhwm = 100
        d.connect(self.snapshot)
        for _ in range(self.n(20)):
            for _ in range(60):
                if not self.left():
                    break
                try:
                    d.send_multipart([b"SNAP", WIDE.encode()], zmq.NOBLOCK)
                    self.count("snapshot_storm")
                except zmq.Again:
                    self.count("snapshot_storm", "refused")
            if not self.left():
                break
            time.sleep(2.0)
        d.close()

    def _http(self, head: bytes, read: bool = True) -> bytes:
        with socket.create_connection(("127.0.0.1", self.web), timeout=5) as c:
            c.sendall(head)
            return c.recv(256) if read else b""

    def wrong_host(self) -> None:
        for _ in range(self.n(2000)):
            if not self.left():
                break
            try:
                got = self._http(b"GET /api/runs HTTP/1.1\r\nHost: evil.example\r\n\r\n")
                self.count("wrong_host", got[9:12].decode("ascii", "replace"))
            except OSError:
                self.count("wrong_host", "error")
            time.sleep(0.005)

    def heads(self) -> None:
        held: list[socket.socket] = []
        line = b"X-Pad: " + b"p" * 1000 + b"\r\n"
        for i in range(self.n(150)):
            if not self.left():
                break
            try:
                c = socket.create_connection(("127.0.0.1", self.web), timeout=5)
                c.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n" + line * 60)  # unfinished
                held.append(c)
                self.count("heads", "unfinished")
                if i % 5 == 0:
                    got = self._http(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n" + line * 70 + b"\r\n")
                    self.count("heads", got[9:12].decode("ascii", "replace"))
            except OSError:
                self.count("heads", "error")
            time.sleep(0.05)
        while self.left():
            time.sleep(0.1)
        for c in held:
            c.close()

    def slow_sse(self) -> None:
        c = socket.socket()
        c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        try:
            c.connect(("127.0.0.1", self.web))
            c.sendall(f"GET /api/runs/{WIDE}/events HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
            self.count("slow_sse", "opened")
            while self.left():
                time.sleep(0.1)  # never reads
        except OSError:
            self.count("slow_sse", "error")
        finally:
            c.close()

    def reconnect_storm(self) -> None:
        rng = random.Random(3)
        for i in range(self.n(1500)):
            if not self.left():
                break
            run = HONEST if i % 2 else WIDE
            try:
                with socket.create_connection(("127.0.0.1", self.web), timeout=5) as c:
                    c.sendall(f"GET /api/runs/{run}/events HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                              f"Last-Event-ID: {rng.randrange(0, 10_000)}\r\n\r\n".encode())
                    got = c.recv(4096)
                    self.count("reconnect_storm", got[9:12].decode("ascii", "replace"))
            except OSError:
                self.count("reconnect_storm", "error")
            time.sleep(0.02)

    def run(self, names: list[str]) -> dict[str, Any]:
        threads = [threading.Thread(target=self._guard, args=(getattr(self, n),), name=n,
                                    daemon=True) for n in names]
        for t in threads:
            t.start()
        for t in threads:
            t.join(max(1.0, self.deadline - time.monotonic() + 15))
        self.counts["_still_running"] = [t.name for t in threads if t.is_alive()]
        self.ctx.destroy(linger=0)
        return self.counts

    def _guard(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception as exc:  # an attack that breaks is reported, never hangs the soak
            self.count(fn.__name__, f"crashed: {exc!r}"[:120])


def _attack(ingest: str, snapshot: str, web: int, seconds: float, scale: float,
            names: list[str], out: Any) -> None:
    out.put(_Attacks(ingest, snapshot, web, time.monotonic() + seconds, scale).run(names))


# -- the damaged journal -------------------------------------------------------------------

def _damaged_journal(data_dir: Path, epochs: int = 200) -> None:
    """An older run, journaled by the real journal, with one byte flipped in its middle."""
    from broker.journal.journal import Journal
    from broker.runs import Runs

    journal = Journal(str(data_dir))
    runs = Runs()
    runs.restore(journal.load())
    runs.recorder = journal.accept
    now = time.time() - 3600
    enc = protocol.encoder.encode
    runs.ingest(enc(protocol.Register(run="old", rank=0, world_size=1, host="h")), now)
    for e in range(epochs):
        now += 1
        runs.ingest(enc(protocol.Metrics(run="old", rank=0, epoch=e, avg_loss=1.0)), now)
        sink = runs.get("old")
        assert sink is not None
        journal.note_seq(sink)
        journal.flush()
    journal.close()
    path = next((data_dir / "runs").glob("old*"))
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))


# -- the soak ------------------------------------------------------------------------------

def _tree_rss(proc: psutil.Process) -> int:
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


def soak(seconds: float, scale: float, attacks: list[str]) -> dict[str, Any]:
    common.raise_nofile()
    spawn = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="rankboard-soak-") as tmp:
        data = Path(tmp) / "data"
        _damaged_journal(data)
        ports = {k: _free_port() for k in ("ingest", "publish", "snapshot")}
        eps = {k: f"tcp://127.0.0.1:{p}" for k, p in ports.items()}
        up = common.Proc(["up", "--ingest", eps["ingest"], "--publish", eps["publish"],
                          "--snapshot", eps["snapshot"], "--host", "127.0.0.1", "--port", "0",
                          "--data-dir", str(data), "--max-runs", str(MAX_RUNS),
                          "--log-level", "WARNING"])
        try:
            return _soak(up, eps, seconds, scale, attacks, spawn)
        finally:
            up.stop()


def _soak(up: common.Proc, eps: dict[str, str], seconds: float, scale: float,
          attacks: list[str], spawn: Any) -> dict[str, Any]:
    def ready() -> bool:
        if up.proc.poll() is not None:
            raise RuntimeError("rankboard up exited:\n" + up.tail())
        return bool(up.find(common._DASHBOARD))
    common.wait_for(ready, 60, "rankboard up's dashboard")
    port = int(up.find(common._DASHBOARD)[0].group(1))
    common.wait_for(lambda: common.http_get(port, "/healthz")[0] == 200, 60, "web /healthz")
    tree = psutil.Process(up.pid)
    # the damaged journal's run, before junk runs evict it: the entries after the flip kept
    old_records = len(common.http_json(port, "/api/runs/old")["records"])
    epochs = int(seconds / EPOCH_PERIOD_S)
    go, honest_out, attack_out = spawn.Event(), spawn.Queue(), spawn.Queue()
    honest = spawn.Process(target=_honest, args=(eps["ingest"], epochs, go, honest_out))
    honest.start()
    common.wait_for(lambda: common.http_get(port, f"/api/runs/{HONEST}")[0] == 200, 60,
                    "the honest run on the web")
    arrivals: dict[int, float] = {}
    readers: list[common.SseReader] = []
    reconnects = [0]
    reading = threading.Event()
    reading.set()

    def read() -> None:
        """The honest run's stream, read as a browser's EventSource reads it: when the
        stream ends (the broker evicted the run at ``--max-runs`` and the web dropped it,
        contract v3 section 6) or cannot be opened (404 until the run's next frame brings it
        back), reconnect with the last id seen, so the replay hands over what was missed."""
        last: int | None = None
        while reading.is_set():
            try:
                reader = common.SseReader(port, HONEST, last_event_id=last)
            except OSError:
                time.sleep(0.05)  # a retry interval, as EventSource's, not synchronisation
                continue
            readers.append(reader)
            try:
                for kind, ident, data, t in reader.events():
                    if ident is not None:
                        last = ident if last is None else max(last, ident)
                    if kind == "epoch":
                        arrivals.setdefault(int(json.loads(data)["epoch"]), t)
            except OSError:
                pass
            reader.close()
            reconnects[0] += 1
    threading.Thread(target=read, daemon=True).start()
    # The same epochs as the broker publishes them (a SUB of the honest run's topic on the
    # feed): the broker's share of each latency, the rest being the web's.
    published: dict[int, float] = {}
    evictions = [0]
    feed_ctx = zmq.Context()
    feed_sub = feed_ctx.socket(zmq.SUB)
    feed_sub.linger = 0
    feed_sub.rcvtimeo = 200
    feed_sub.setsockopt(zmq.SUBSCRIBE, b"r:" + HONEST.encode())
    feed_sub.connect(eps["publish"])

    def watch_feed() -> None:
        from broker import feed
        while reading.is_set():
            try:
                parts = feed_sub.recv_multipart()
            except zmq.Again:
                continue
            except zmq.ZMQError:
                return
            t = time.monotonic()
            update = feed.decode_update(parts)
            if isinstance(update, feed.EventUpdate) and update.kind == "epoch":
                published.setdefault(int(update.data["epoch"]), t)
            elif isinstance(update, feed.EventUpdate) and update.kind == "evicted":
                evictions[0] += 1
    feed_thread = threading.Thread(target=watch_feed, daemon=True)
    feed_thread.start()
    peak = [_tree_rss(tree)]
    idle_rss = peak[0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _tree_rss(tree))
            stop.wait(0.1)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    attacker = spawn.Process(target=_attack, args=(eps["ingest"], eps["snapshot"], port,
                                                   seconds, scale, attacks, attack_out))
    attacker.start()
    go.set()
    sent = honest_out.get(timeout=seconds + 120)
    honest.join(30)
    counts = attack_out.get(timeout=120)
    attacker.join(30)
    # what the honest run was served: epochs on the stream, steps on /steps
    want_epochs = {e for e, _ in sent["epochs"]}
    try:
        common.wait_for(lambda: want_epochs <= set(arrivals), 30, "the honest epochs on SSE")
    except AssertionError:
        pass  # counted as lost below

    def served_steps() -> int:
        status, body = common.http_get(port, f"/api/runs/{HONEST}/steps?metric=loss&points=10000")
        return sum(b[7] for b in json.loads(body)["buckets"]) if status == 200 else 0
    try:
        common.wait_for(lambda: served_steps() >= sent["steps"], 30, "the honest steps closed")
    except AssertionError:
        pass  # counted as lost below
    steps_served = served_steps()
    stop.set()
    sampler.join(5)
    reading.clear()
    for reader in readers:
        reader.close()
    feed_thread.join(5)
    feed_sub.close()
    feed_ctx.term()
    broker_lat = [(published[e] - t) * 1000 for e, t in sent["epochs"] if e in published]
    lat = [(arrivals[e] - t) * 1000 for e, t in sent["epochs"] if e in arrivals]
    t0 = sent["epochs"][0][1] if sent["epochs"] else 0.0
    worst = sorted(((round((arrivals[e] - t) * 1000, 1), e, round(t - t0, 1))
                    for e, t in sent["epochs"] if e in arrivals), reverse=True)[:5]
    lost = (len(want_epochs - set(arrivals))) + max(0, sent["steps"] - steps_served)
    status, metrics_text = common.http_get(port, "/metrics")
    limits = [line for line in metrics_text.decode().splitlines()
              if line.startswith(("rankboard_frames_rejected_total", "rankboard_web_limited_total",
                                  "rankboard_journal_total"))]
    return {
        "p99": common.percentile(lat, 99), "p50": common.percentile(lat, 50),
        "max_lat": max(lat) if lat else float("nan"),
        "peak_mib": peak[0] / 2**20, "idle_mib": idle_rss / 2**20, "lost": lost,
        "epochs": len(want_epochs), "epochs_seen": len(set(arrivals) & want_epochs),
        "steps": sent["steps"], "steps_served": steps_served,
        "healthz": common.http_get(port, "/healthz")[0], "attacks": counts,
        "limits": limits, "old_records": old_records, "up_alive": up.proc.poll() is None,
        "sse_reconnects": reconnects[0], "honest_evictions": evictions[0],
        "worst": [{"ms": ms, "epoch": e, "at_s": at,
                   "broker_ms": round((published[e] - sent["epochs"][e][1]) * 1000, 1)
                   if e in published else None} for ms, e, at in worst],
        "broker_p99_ms": round(common.percentile(broker_lat, 99), 1) if broker_lat else None,
        "broker_p50_ms": round(common.percentile(broker_lat, 50), 1) if broker_lat else None,
    }


def run(quick: bool = False, attacks: list[str] | None = None) -> list[dict[str, Any]]:
    seconds, scale = (6.0, 0.25) if quick else (60.0, 1.0)
    r = soak(seconds, scale, ATTACKS if attacks is None else attacks)
    extra = {k: v for k, v in r.items() if k not in ("p99", "peak_mib", "lost")}
    extra["seconds"] = seconds
    return [
        common.result("hostile_soak_honest_e2e_p99_ms", round(r["p99"], 1), "ms", **extra),
        common.result("hostile_soak_max_rss_mib", round(r["peak_mib"], 1), "MiB"),
        common.result("hostile_soak_honest_lost", r["lost"], "count"),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="6 s of attacks at a quarter size")
    parser.add_argument("--attacks", help="comma-separated subset of " + ",".join(ATTACKS)
                        + " (default: all; '' for none, the honest run alone)")
    args = parser.parse_args()
    names = None if args.attacks is None else [a for a in args.attacks.split(",") if a]
    for name in names or []:
        if name not in ATTACKS:
            parser.error(f"unknown attack {name!r}")
    for line in run(args.quick, names):
        print(json.dumps(line))


if __name__ == "__main__":
    main()
