"""Many SSE clients in one process (gevent, raw sockets), for the fan-out benchmark.

``python bench/sse_clients.py PORT RUN N SKIP`` opens N streams of ``/api/runs/RUN/events``
(each ignores the first SKIP ``epoch`` events: the replay of records already closed),
prints ``ready`` once every stream has received its first ``run`` event, then prints
``got <id>`` each time the last of its N clients has received the ``epoch`` event with that
id. When stdin closes it prints one JSON line ``{"times": {id: [monotonic receive times]},
"cpu": seconds of CPU this process used after ready, "errors": n}`` and exits.

Why it is cheap enough not to be what the benchmark measures: a client does one ``recv``
per readiness and one byte search for ``event: epoch`` per received chunk (no JSON parsing,
no HTTP library); its CPU time per event is reported next to the web's, so the two can be
compared (see BENCHMARKS.md).
"""
from __future__ import annotations

from gevent import monkey

monkey.patch_all()

import json  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import gevent  # noqa: E402
import gevent.event  # noqa: E402

MARK = b"event: epoch\n"


def main() -> int:
    port, run, n, skip = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    times: dict[int, list[float]] = {}
    counts: dict[int, int] = {}
    ready = [0]
    all_ready = gevent.event.Event()
    errors = [0]
    request = (f"GET /api/runs/{run}/events HTTP/1.1\r\nHost: 127.0.0.1\r\n"
               "Accept: text/event-stream\r\n\r\n").encode()

    def client() -> None:
        try:
            sock = socket.create_connection(("127.0.0.1", port), timeout=120)
        except OSError:
            errors[0] += 1
            return
        try:
            sock.sendall(request)
            buf = b""
            seen_run = False
            skipped = 0
            while True:
                data = sock.recv(262144)
                if not data:
                    return
                now = time.monotonic()
                buf += data
                if not seen_run:
                    if b"event: run\n" not in buf:
                        continue
                    seen_run = True
                    ready[0] += 1
                    if ready[0] == n:
                        all_ready.set()
                while True:
                    i = buf.find(MARK)
                    if i < 0:
                        buf = buf[-len(MARK):]
                        break
                    j = buf.rfind(b"id: ", 0, i)
                    k = buf.find(b"\n", j)
                    seq = int(buf[j + 4:k])
                    buf = buf[i + len(MARK):]
                    if skipped < skip:
                        skipped += 1
                        continue
                    times.setdefault(seq, []).append(now)
                    c = counts[seq] = counts.get(seq, 0) + 1
                    if c == n:
                        print(f"got {seq}", flush=True)
        except OSError:
            errors[0] += 1
        finally:
            sock.close()

    greenlets = []
    for i in range(n):
        greenlets.append(gevent.spawn(client))
        if i % 50 == 49:
            gevent.sleep(0.02)  # keep the listen backlog from overflowing
    all_ready.wait()
    print("ready", flush=True)
    import resource

    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    gevent.get_hub().threadpool.spawn(sys.stdin.read).get()
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    print(json.dumps({"times": times, "cpu": cpu, "errors": errors[0]}), flush=True)
    gevent.killall(greenlets, timeout=5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
