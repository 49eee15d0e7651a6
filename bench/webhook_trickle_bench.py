"""webhook_trickle_good_url_delay_s (issue 32, finding 6): a good webhook URL beside one
that trickles a header byte every 4 s (real sockets, the real notifier, its default 5 s
deadline and retries). Five POSTs go out one a second; the figure is the longest any of
them took to reach the good URL. Before (one thread, a 5 s timeout per read) the trickler
held every delivery: 62 s with every counter at 0 in the issue.

    python bench/webhook_trickle_bench.py
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import result  # noqa: E402

from broker.webhooks.notifier import WebhookNotifier  # noqa: E402
from tests.support.receiver import Receiver, Trickler  # noqa: E402


def run(quick: bool = False) -> list[dict[str, Any]]:
    """Five deliveries a second apart beside the trickler (the same in both runs: ~6 s)."""
    good, bad = Receiver(), Trickler(interval=4.0)
    notifier = WebhookNotifier([bad.url, good.url]).start()
    delays = []
    try:
        for i in range(5):
            t0 = time.monotonic()
            notifier.run_ended(f"run{i}", "complete")
            while good.count() < i + 1 and time.monotonic() - t0 < 120:
                time.sleep(0.005)
            delays.append(time.monotonic() - t0)
            time.sleep(max(0.0, 1.0 - (time.monotonic() - t0)))
    finally:
        counters = notifier.counters()
        notifier.close()
        bad.close()
        good.close()
    return [result("webhook_trickle_good_url_delay_s", round(max(delays), 3), "s",
                   delays=[round(d, 3) for d in delays], counters=counters)]


def main() -> None:
    for line in run():
        print(json.dumps(line))


if __name__ == "__main__":
    main()
