"""ingest_ratio: broker frames/s over what a bare pyzmq PULL loop receives from the same senders;
ingest_floor_ratio: broker frames/s over a PULL loop that also decodes (resources frames).

``ingest_floor_ratio`` (issue 11) compares with the floor of any broker that validates what it
receives: the same senders pushing only ``resources`` frames (two per rank and round), received
by a bare PULL loop that runs ``protocol.decode`` on each frame, and by the real broker.

Senders: ``SENDERS`` separate processes (spawned), each playing a slice of the ranks of one
run (8 ranks per host) and pushing a realistic mix, pre-encoded before the start so that
encoding is not what they spend their time on: per rank and epoch a ``resources`` frame (one
GPU) and a ``metrics`` frame (4 scalars, the latest sample riding along, as the agent sends
it). Epochs close as they complete, so the broker also builds records and publishes them.
Registers are sent first and applied before the clock starts.

Receivers, one after the other, fed by identical sender processes:

* baseline: a raw pyzmq PULL socket in this process, ``recv()`` until every frame arrived
  (the physical ceiling of one Python thread receiving these messages over loopback TCP);
* broker: the real :class:`broker.server.BrokerServer` (journal on a tmp data dir, PUB and
  snapshot sockets bound) serving in a thread of this process: full decode, sink apply,
  journal, publish. Its ``runs.accepted`` counter says when every frame was taken; it is
  polled every 2 ms by the main thread (which otherwise sleeps).

``--hanging-webhook`` (issue 15: delivery never slows ingest) measures ``ingest_floor_ratio``
twice on frames whose samples carry an XID (every fourth sample of each rank, so the broker
raises a ``gpu_xid`` alert on one frame in four): once without webhooks, once with a webhook
receiver on loopback that holds every POST open (10 s, past the notifier's 5 s timeout). A POST
is already hanging when the clock starts (the notifier's grouping window is 0.2 s here so the
set-up does not wait 5 s; the window is not what is measured), so the broker's loop keeps
handing alerts to a notifier whose thread is stuck. Not part of ``run_all.py``.

Both clocks start when the senders are released (one shared ``Event``) and stop at the last
frame, so both include the same sender start-up. ``value`` is the broker's frames/s,
``baseline`` the raw loop's, ``ratio`` broker / raw. ``decode_only_ratio`` (BENCHMARKS.md)
is ``protocol.decode`` alone over the same frames (no sockets, no sink) / raw: the ceiling of
any fully decoding broker in this interpreter.
"""
from __future__ import annotations

import statistics
import tempfile
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any

import zmq
from common import Senders, broker_gc, pull_rate, push_all, result

from broker.server import BrokerServer
from broker.webhooks.notifier import WebhookNotifier
from rank_agent import protocol
from rank_agent.protocol import GpuSample, Metrics, Register, Resources, ResourceSample

SENDERS = 4
RANKS = 256
RANKS_PER_HOST = 8
RUN = "bench-ingest"


def _sample(rank: int, i: int, xids: bool = False) -> ResourceSample:
    xid = [79] if xids and (rank + i) % 4 == 0 else []
    gpu = GpuSample(device_index=rank % RANKS_PER_HOST, name="NVIDIA H100 80GB HBM3",
                    util_percent=float(90 + i % 10), vram_allocated_bytes=(60 << 30) + i,
                    vram_total_bytes=80 << 30, temperature_c=61.0, power_w=650.5,
                    xid_errors=xid)
    return ResourceSample(cpu_percent=42.5, ram_used_bytes=500 << 30, ram_total_bytes=1 << 40,
                          gpu_util_percent=gpu.util_percent, vram_allocated_bytes=gpu.vram_allocated_bytes,
                          vram_total_bytes=80 << 30, gpus=[gpu])


def frames_for(sender: int, epochs: int, resources_only: bool = False,
               xids: bool = False) -> list[bytes]:
    """The frames one sender pushes, in send order: per epoch, per rank, resources + metrics
    (``resources_only``: two resources frames instead, as a sampler-heavy cluster sends;
    ``xids``: every fourth sample of a rank reports an XID)."""
    enc = protocol.encoder.encode
    ranks = range(sender, RANKS, SENDERS)
    out = []
    for e in range(epochs):
        for r in ranks:
            sample = _sample(r, 2 * e, xids)
            out.append(enc(Resources(run=RUN, rank=r, sample=sample)))
            if resources_only:
                out.append(enc(Resources(run=RUN, rank=r, sample=_sample(r, 2 * e + 1, xids))))
                continue
            out.append(enc(Metrics(run=RUN, rank=r, epoch=e, avg_loss=1.0 / (e + 1), batches=100,
                                   samples=6400, epoch_ms=1000.0 + r, share_complete_ms=900.0,
                                   scalars={"acc": (90.0, 100), "grad_norm": (1.5, 1), "lr": (1e-3, 1),
                                            "tokens_per_s": (12345.0, 1)},
                                   resources=sample)))
    return out


def registers() -> list[bytes]:
    enc = protocol.encoder.encode
    return [enc(Register(run=RUN, rank=r, world_size=RANKS, host=f"node-{r // RANKS_PER_HOST:03d}",
                         local_rank=r % RANKS_PER_HOST, total_epochs=100000)) for r in range(RANKS)]


def _senders(endpoint: str, epochs: int, resources_only: bool = False,
             xids: bool = False) -> Senders:
    return Senders(endpoint, partial(frames_for, resources_only=resources_only, xids=xids),
                   SENDERS, epochs)


def _total(epochs: int) -> int:
    return SENDERS * len(range(0, RANKS, SENDERS)) * epochs * 2


def floor_rate(epochs: int, xids: bool = False) -> float:
    """The floor of any broker that validates what it receives: a bare PULL loop that runs
    ``protocol.decode`` on each frame (resources frames, same senders as :func:`broker_rate`
    with ``resources_only``)."""
    return pull_rate(lambda ep: _senders(ep, epochs, resources_only=True, xids=xids),
                     _total(epochs), decode=True)


def raw_rate(epochs: int) -> float:
    return pull_rate(lambda ep: _senders(ep, epochs), _total(epochs))


def broker_rate(epochs: int, resources_only: bool = False, xids: bool = False,
                webhook: Any = None) -> tuple[float, int]:
    """The broker's frames/s and closed records; ``webhook``: a hanging receiver
    (``tests.support.receiver.Receiver``) holding a POST open when the clock starts."""
    with broker_gc(), tempfile.TemporaryDirectory(prefix="rankboard-bench-") as tmp:
        hooks = WebhookNotifier([webhook.url] if webhook else [], window=0.2)
        server = BrokerServer("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", "tcp://127.0.0.1:*",
                              data_dir=Path(tmp) / "data", webhooks=hooks)
        endpoints = server.bind()
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            ctx = zmq.Context()
            push = ctx.socket(zmq.PUSH)
            push.connect(endpoints["ingest"])
            for f in registers():
                push.send(f)
            if webhook:  # one alert now, so a POST hangs before the clock starts
                push.send(protocol.encoder.encode(Resources(run=RUN, rank=0, sample=ResourceSample(
                    gpus=[GpuSample(device_index=0, name="x", xid_errors=[13])]))))
            push.close(linger=-1)
            ctx.term()
            deadline = time.monotonic() + 30
            while server.runs.accepted < RANKS:
                if time.monotonic() > deadline:
                    raise RuntimeError("registers not applied")
                time.sleep(0.005)
            deadline = time.monotonic() + 30
            while webhook and webhook.count() < 1:
                if time.monotonic() > deadline:
                    raise RuntimeError("no webhook POST in flight")
                time.sleep(0.005)
            base = server.runs.accepted
            total = _total(epochs)
            senders = _senders(endpoints["ingest"], epochs, resources_only, xids)
            t0 = senders.start()
            deadline = time.monotonic() + 300
            while server.runs.accepted - base < total:
                if time.monotonic() > deadline:
                    raise RuntimeError("broker did not take every frame")
                time.sleep(0.002)
            dt = time.perf_counter() - t0
            senders.join()
            sink = server.runs.get(RUN)
            records = len(sink.records) if sink is not None else 0
            rejected = server.runs.rejected_total
            if rejected:
                raise RuntimeError(f"broker rejected {rejected} frames: {dict(server.runs.rejected)}")
        finally:
            server.stop()
            thread.join(10)
            server.close()
    return total / dt, records


def decode_rate(epochs: int) -> float:
    """Frames/s of ``protocol.decode`` alone over the same frames, in one thread, no sockets:
    a ceiling for any broker that fully decodes what it receives."""
    frames = [f for s in range(SENDERS) for f in frames_for(s, epochs)]
    decode = protocol.decode
    t0 = time.perf_counter()
    for f in frames:
        decode(f)
    return len(frames) / (time.perf_counter() - t0)


# ------------------------------------------------------- 64 ranks, 2 senders, web (issue 17)

RANKS_64 = 64
SENDERS_64 = 2
RUN_64 = "bench-ingest-64"


def frames_64(sender: int, n: int) -> list[bytes]:
    """``n`` resources frames over the sender's half of 64 ranks (a sampler-heavy cluster),
    then one ``metrics`` frame of epoch 0 per rank: the frame whose record ends the clock."""
    enc = protocol.encoder.encode
    ranks = list(range(sender, RANKS_64, SENDERS_64))
    out = [enc(Resources(run=RUN_64, rank=ranks[i % len(ranks)], sample=_sample(ranks[i % len(ranks)], i)))
           for i in range(n)]
    for r in ranks:
        out.append(enc(Metrics(run=RUN_64, rank=r, epoch=0, avg_loss=1.0, batches=100, samples=6400,
                               epoch_ms=1000.0, scalars={"acc": (90.0, 100)})))
    return out


def _registers_64() -> list[bytes]:
    enc = protocol.encoder.encode
    return [enc(Register(run=RUN_64, rank=r, world_size=RANKS_64, host=f"node-{r // RANKS_PER_HOST}",
                         local_rank=r % RANKS_PER_HOST, total_epochs=1)) for r in range(RANKS_64)]


def floor_64(n: int) -> tuple[float, float]:
    """(frames/s, CPU s per frame) of the bare PULL + decode loop over the 64-rank frames."""
    cpu: dict[str, float] = {}
    rate = pull_rate(lambda ep: Senders(ep, frames_64, SENDERS_64, n),
                     SENDERS_64 * (n + RANKS_64 // SENDERS_64), decode=True, cpu=cpu)
    return rate, cpu["per_frame"]


def broker_64_thread(n: int) -> tuple[float, float]:
    """(frames/s, broker thread CPU s per frame): the real BrokerServer in a thread of this
    process, no web, until it accepted every frame (as ``ingest_floor_ratio`` measures)."""
    cpu: dict[str, float] = {}
    total = SENDERS_64 * (n + RANKS_64 // SENDERS_64)
    with broker_gc(), tempfile.TemporaryDirectory(prefix="rankboard-bench-") as tmp:
        server = BrokerServer("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", "tcp://127.0.0.1:*",
                              data_dir=Path(tmp) / "data")
        endpoints = server.bind()

        def serve() -> None:
            server.serve_forever()
            cpu["end"] = time.thread_time()

        def mark() -> None:
            cpu["start"] = time.thread_time()
        server.runs.on_register = lambda frame: mark() if frame.rank == RANKS_64 - 1 else None
        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        try:
            push_all(endpoints["ingest"], _registers_64())
            _wait(lambda: server.runs.accepted >= RANKS_64, 30, "registers")
            base = server.runs.accepted
            senders = Senders(endpoints["ingest"], frames_64, SENDERS_64, n)
            t0 = senders.start()
            _wait(lambda: server.runs.accepted - base >= total, 300, "every frame")
            dt = time.perf_counter() - t0
            senders.join()
        finally:
            server.stop()
            thread.join(10)
            server.close()
    return total / dt, (cpu["end"] - cpu["start"]) / total


def broker_64_web(n: int) -> dict[str, float]:
    """The public surface: broker and web processes, 2 sender processes; the clock stops
    when ``/history`` serves epoch 0 (the last frames' record). CPU of both processes."""
    import psutil
    from common import http_get
    from steps_bench import Server

    total = SENDERS_64 * (n + RANKS_64 // SENDERS_64)
    with tempfile.TemporaryDirectory(prefix="rankboard-bench-") as tmp:
        srv = Server(Path(tmp) / "data")
        try:
            srv.start_broker()
            srv.start_web()
            assert srv.broker is not None and srv.web is not None
            broker, web = psutil.Process(srv.broker.pid), psutil.Process(srv.web.pid)
            push_all(srv.endpoints["ingest"], _registers_64())
            _wait(lambda: http_get(srv.port, f"/api/runs/{RUN_64}")[0] == 200, 30, "the run")
            senders = Senders(srv.endpoints["ingest"], frames_64, SENDERS_64, n)
            b0, w0 = sum(broker.cpu_times()[:2]), sum(web.cpu_times()[:2])
            t0 = senders.start()

            def served() -> bool:
                status, body = http_get(srv.port, f"/api/runs/{RUN_64}/history")
                return status == 200 and body.startswith(b"[{")
            _wait(served, 300, "epoch 0 served", interval=0.02)
            dt = time.perf_counter() - t0
            b1, w1 = sum(broker.cpu_times()[:2]), sum(web.cpu_times()[:2])
            senders.join()
        finally:
            srv.close()
    return {"rate": total / dt, "broker_cpu": (b1 - b0) / total, "web_cpu": (w1 - w0) / total}


def _wait(pred: Any, timeout: float, what: str, interval: float = 0.002) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(interval)


def run_64(quick: bool) -> dict[str, Any]:
    n = 20_000 if quick else 200_000
    floors, webs, threads = [], [], []
    for _ in range(1 if quick else 3):
        floors.append(floor_64(n))
        webs.append(broker_64_web(n))
        threads.append(broker_64_thread(n))
    floor = statistics.median(f[0] for f in floors)
    floor_cpu = statistics.median(f[1] for f in floors)
    rate = statistics.median(w["rate"] for w in webs)
    thread_rate = statistics.median(t[0] for t in threads)
    thread_cpu = statistics.median(t[1] for t in threads)
    broker_cpu = statistics.median(w["broker_cpu"] for w in webs)
    web_cpu = statistics.median(w["web_cpu"] for w in webs)
    return result("ingest_floor_ratio_64r", round(rate), "frames/s", baseline=round(floor),
                  ratio=round(rate / floor, 3), frames=SENDERS_64 * (n + RANKS_64 // SENDERS_64),
                  senders=SENDERS_64, ranks=RANKS_64, web=True,
                  no_web_in_thread_ratio=round(thread_rate / floor, 3),
                  floor_cpu_us_per_frame=round(floor_cpu * 1e6, 2),
                  broker_thread_cpu_us_per_frame=round(thread_cpu * 1e6, 2),
                  broker_process_cpu_us_per_frame=round(broker_cpu * 1e6, 2),
                  web_cpu_us_per_frame=round(web_cpu * 1e6, 2),
                  cpu_ratio=round(floor_cpu / thread_cpu, 3) if thread_cpu else None)


def run(quick: bool) -> list[dict[str, Any]]:
    epochs = 40 if quick else 200
    # Floor and broker alternate, three of each (one in --quick); the medians are compared:
    # on 2 shared cores one pair alone swings by 2x either way.
    floors, rates = [], []
    for _ in range(1 if quick else 3):
        floors.append(floor_rate(epochs))
        rates.append(broker_rate(epochs, resources_only=True)[0])
    floor, res_rate = statistics.median(floors), statistics.median(rates)
    out = [result("ingest_floor_ratio", round(res_rate), "frames/s", baseline=round(floor),
                  ratio=round(res_rate / floor, 3), frames=SENDERS * (RANKS // SENDERS) * epochs * 2,
                  senders=SENDERS, ranks=RANKS, kind="resources",
                  floors=[round(f) for f in floors], brokers=[round(r) for r in rates])]
    raw = raw_rate(epochs)
    rate, records = broker_rate(epochs)
    dec = decode_rate(epochs)
    out.append(run_64(quick))
    return out + [result("ingest_ratio", round(rate), "frames/s", baseline=round(raw), ratio=round(rate / raw, 3),
                   frames=SENDERS * (RANKS // SENDERS) * epochs * 2, senders=SENDERS, ranks=RANKS,
                   records=records, decode_only_fps=round(dec), decode_only_ratio=round(dec / raw, 3))]


def hanging_webhook(quick: bool) -> list[dict[str, Any]]:
    """``ingest_floor_ratio`` on XID-bearing frames, without webhooks and with a receiver that
    hangs (see the module docstring): two results, each against its own floor runs."""
    from tests.support.receiver import Receiver

    epochs = 40 if quick else 200
    receiver = Receiver()
    receiver.hang = True
    out = []
    try:
        for name, hook in (("ingest_floor_ratio", None),
                           ("ingest_floor_ratio_hanging_webhook", receiver)):
            floors, rates = [], []
            for _ in range(1 if quick else 3):
                floors.append(floor_rate(epochs, xids=True))
                rates.append(broker_rate(epochs, resources_only=True, xids=True, webhook=hook)[0])
            floor, rate = statistics.median(floors), statistics.median(rates)
            out.append(result(name, round(rate), "frames/s", baseline=round(floor),
                              ratio=round(rate / floor, 3), kind="resources, 1 in 4 with an XID",
                              webhook="hanging" if hook else None, posts_held=receiver.count(),
                              floors=[round(f) for f in floors], brokers=[round(r) for r in rates]))
    finally:
        receiver.close()
    return out


if __name__ == "__main__":
    import argparse
    import json

    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes, one run of each")
    parser.add_argument("--hanging-webhook", action="store_true",
                        help="ingest_floor_ratio without webhooks and with a receiver that hangs")
    args = parser.parse_args()
    lines = hanging_webhook(args.quick) if args.hanging_webhook else run(args.quick)
    for line in lines:
        extra = line.pop("_extra", None)
        print(json.dumps({**line, **(extra or {})}))
