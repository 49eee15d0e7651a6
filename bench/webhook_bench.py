"""webhook_storm_posts: 1,024 ranks go stale together -> how many POSTs a receiver gets.

A real HTTP receiver on loopback (``http.server`` in a thread) and a real
:class:`broker.webhooks.notifier.WebhookNotifier` with the contract's grouping window (5 s; 1 s in
quick mode, which changes nothing but the wait). The 1,024 ``stale`` alerts are raised the way
the broker's liveness tick raises them when a whole job dies: one per rank, 128 hosts, spread
over a few hundred milliseconds. The figure is the number of POSTs received once the window has
ended and one more window has passed with the notifier idle (target 1). The details give the
``enqueue_us`` p99 of the calls the broker's loop makes (they never wait for delivery).

This measures the grouping and delivery path of the notifier the broker runs, end to end over
real HTTP; the broker's own path (its liveness tick raising the 1,024 alerts) is checked by
tests/broker/test_alert_webhooks_e2e.py.

    python bench/webhook_bench.py [--quick]
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import percentile, result, wait_for  # noqa: E402

from broker.webhooks.notifier import WebhookNotifier  # noqa: E402


def _receiver() -> tuple[ThreadingHTTPServer, list[bytes]]:
    bodies: list[bytes] = []
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = self.rfile.read(int(self.headers["Content-Length"]))
            with lock:
                bodies.append(body)
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    return server, bodies


def storm(quick: bool, ranks: int = 1024) -> dict[str, Any]:
    window = 1.0 if quick else 5.0
    server, bodies = _receiver()
    url = f"http://127.0.0.1:{server.server_address[1]}/hook"
    notifier = WebhookNotifier([url], window=window).start()
    try:
        enqueue = []
        t0 = time.monotonic()
        for rank in range(ranks):
            t = time.perf_counter()
            notifier.alert("run-7", "stale", rank, f"no frame for 30s from rank {rank}",
                           host=f"node{rank // 8:03d}")
            enqueue.append((time.perf_counter() - t) * 1e6)
            if rank % 64 == 63:
                time.sleep(0.01)  # a tick's worth of spread, as the liveness sweep raises them
        wait_for(lambda: notifier.counters()["sent"] >= 1, timeout=window + 30, what="the first POST")
        first_after = time.monotonic() - t0
        time.sleep(window)  # one more window: a second POST would have come by now
        wait_for(lambda: notifier.pending() == 0, timeout=30, what="an idle notifier")
        posts = len(bodies)
        payload = json.loads(bodies[0])
        counters = notifier.counters()
    finally:
        notifier.close()
        server.shutdown()
        server.server_close()
    return result("webhook_storm_posts", posts, "posts", ranks=ranks, window_s=window,
                  ranks_in_first_post=payload["count"], hosts_in_first_post=len(payload["hosts"]),
                  first_post_after_s=round(first_after, 2),
                  enqueue_p99_us=round(percentile(enqueue, 99), 2), **counters)


def run(quick: bool) -> list[dict[str, Any]]:
    return [storm(quick)]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--details", action="store_true", help="print the details too (stderr)")
    args = parser.parse_args()
    for line in run(args.quick):
        extra = line.pop("_extra", {})
        print(json.dumps(line))
        if args.details:
            print(json.dumps(extra), file=sys.stderr)
