"""Alert webhooks (PROTOCOL.md section 3.1, v3): an alert at 3 a.m. reaches a chat channel.

Two parts, as everywhere in the broker:

* :class:`AlertGrouper` is **pure** (an injected ``now`` in every call, no I/O): it groups the
  alerts of one (run, kind) raised within ``window`` seconds of the first of them into **one**
  payload when that window ends (1,024 ranks going stale at once are one message), suppresses
  a (run, kind, rank) already posted until ``repeat`` seconds have passed (and it is raised
  again), and builds the ``resolved`` payload of a run that ended.
* :class:`WebhookNotifier` is the shell: one daemon thread that flushes the grouper's due
  groups and POSTs them to every URL. The broker's loop only calls :meth:`~WebhookNotifier.alert`
  and :meth:`~WebhookNotifier.run_ended`, which take a lock for a few microseconds and return
  (**delivery never slows ingest**); all waiting (grouping windows, HTTP, retry delays) happens
  on the thread. POSTs wait in a bounded queue (1,000: beyond it the oldest is dropped), each
  attempt has a 5 s timeout, and a connection error, a timeout, a 5xx or a 429 is retried after
  1, 2 and 4 s; a retry waits in the queue without holding the thread, so one slow receiver
  delays the others only by its timeout.

Counters (the heartbeat's and ``/metrics``' ``rankboard_webhooks_*_total``): ``sent`` POSTs
delivered (a 2xx answer); ``failed`` attempts that did not deliver (each connection error,
timeout or error status, retried or not); ``dropped`` POSTs given up undelivered (pushed out
of the full queue, out of retries, refused with a 4xx other than 429, or left when the
broker closed).

A webhook URL often *is* the secret (Slack's and Discord's carry their token in the path),
so :func:`redact` is what logs show of it: scheme and host only. Only the standard library
speaks HTTP here (``urllib.request``), so the broker needs no extra dependency.
"""
from __future__ import annotations

import heapq
import http.client
import itertools
import json
import logging
import os
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import deque
from typing import Any, Callable, Iterable, Mapping, NamedTuple, Optional, Sequence

from rank_agent.ratelimit import RateLimitedLog

log = logging.getLogger(__name__)

#: Seconds alerts of one (run, kind) are gathered before their one POST goes out.
GROUP_WINDOW = 5.0
#: ``--alert-repeat`` default: a (run, kind, rank) is posted again only after this long.
DEFAULT_REPEAT = 3600.0
#: POSTs waiting at most (beyond: the oldest is dropped, counted).
QUEUE_MAX = 1000
#: Seconds one attempt may take (connect and each read).
TIMEOUT = 5.0
#: Waits before the retries of a POST that met a connection error, timeout, 5xx or 429.
RETRY_DELAYS = (1.0, 2.0, 4.0)
#: Environment variable holding webhook URLs, separated by whitespace (section 3.1).
ENV_VAR = "RANKBOARD_ALERT_WEBHOOK"
#: Hosts named in a chat line before "…".
_TEXT_HOSTS = 1
#: Longest chat line: Discord refuses a ``content`` over 2,000 characters (Slack takes 40,000).
MAX_TEXT = 2000


def redact(url: str) -> str:
    """What may be shown of a webhook URL: ``scheme://host[:port]`` (never path, query,
    user info or fragment, where the tokens are)."""
    try:
        parts = urllib.parse.urlsplit(url)
        host = parts.hostname or "?"
        port = f":{parts.port}" if parts.port else ""
    except ValueError:
        return "<invalid URL>"
    if ":" in host:
        host = f"[{host}]"
    return f"{parts.scheme or '?'}://{host}{port}"


def webhook_urls(flags: Iterable[str] = (), environ: Mapping[str, str] | None = None) -> list[str]:
    """The URLs of ``--alert-webhook`` (repeatable) and ``RANKBOARD_ALERT_WEBHOOK``
    (whitespace-separated), flags first, duplicates once.

    Raises :class:`ValueError` with a one-line reason that shows only scheme and host for a
    URL that is not ``http(s)://host...``.
    """
    env = os.environ if environ is None else environ
    out: list[str] = []
    for url in [*flags, *env.get(ENV_VAR, "").split()]:
        url = url.strip()
        if not url:
            continue
        try:
            parts = urllib.parse.urlsplit(url)
            ok = parts.scheme in ("http", "https") and bool(parts.hostname)
            parts.port  # noqa: B018 - raises ValueError for a bad port
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(f"alert webhook {redact(url)} is not an http(s) URL with a host")
        if url not in out:
            out.append(url)
    return out


def run_link(public_url: str | None, run: str) -> str | None:
    """The dashboard link of a run: ``<public url>/#run=<run id percent-encoded>``."""
    if not public_url:
        return None
    # quote() with safe="" leaves exactly A-Z a-z 0-9 - . _ ~ unencoded
    return public_url.rstrip("/") + "/#run=" + urllib.parse.quote(run, safe="")


class _Group:
    """Alerts of one (run, kind) gathered in one window."""

    __slots__ = ("first_at", "message", "ranks", "hosts")

    def __init__(self, first_at: float, message: str) -> None:
        self.first_at = first_at
        self.message = message
        self.ranks: set[int] = set()
        self.hosts: set[str] = set()


class AlertGrouper:
    """Grouping, repeat suppression and payloads of section 3.1; pure, not thread-safe.

    ``now`` is unix seconds (it becomes the payload's ``at``). Memory is bounded by the
    alerts of the last ``repeat`` seconds: older posted keys are swept as groups flush.
    """

    def __init__(self, *, window: float = GROUP_WINDOW, repeat: float = DEFAULT_REPEAT,
                 public_url: str | None = None) -> None:
        self.window = window
        self.repeat = repeat
        self.public_url = public_url
        self._groups: dict[tuple[str, str], _Group] = {}
        self._posted: dict[tuple[str, str, int | None], float] = {}
        self._next_sweep = 0.0

    def alert(self, run: str, kind: str, rank: int | None, message: str, now: float,
              host: str | None = None) -> bool:
        """Take one raised alert; False when it is suppressed (posted less than ``repeat`` ago)."""
        key = (run, kind, rank)
        last = self._posted.get(key)
        if last is not None and now - last < self.repeat:
            return False
        self._posted[key] = now
        group = self._groups.get((run, kind))
        if group is None:
            group = self._groups[(run, kind)] = _Group(now, message)
        if rank is not None:
            group.ranks.add(rank)
            if host:
                group.hosts.add(host)
        return True

    def next_due(self) -> float | None:
        """When the earliest open group's window ends (``None``: no group open)."""
        if not self._groups:
            return None
        return min(g.first_at for g in self._groups.values()) + self.window

    def due(self, now: float) -> list[dict[str, Any]]:
        """The payloads of every group whose window has ended by ``now`` (removed)."""
        out = []
        for key in [k for k, g in self._groups.items() if g.first_at + self.window <= now]:
            out.append(self._firing(key[0], key[1], self._groups.pop(key)))
        if now >= self._next_sweep:
            self._next_sweep = now + min(self.repeat, 60.0)
            for key2 in [k for k, t in self._posted.items() if now - t >= self.repeat]:
                del self._posted[key2]
        return out

    def run_ended(self, run: str, status: str, now: float) -> list[dict[str, Any]]:
        """A run completed or failed: its open groups at once, then the ``resolved`` payload.

        The run's repeat memory is forgotten: a run reopened by a new registration alerts
        afresh.
        """
        out = [self._firing(run, kind, self._groups.pop((run, kind)))
               for kind in [k[1] for k in self._groups if k[0] == run]]
        for key in [k for k in self._posted if k[0] == run]:
            del self._posted[key]
        kind = "run_failed" if status == "failed" else "run_complete"
        message = "run failed" if status == "failed" else "run complete"
        text = f"[rankboard] {run}: {message}"
        out.append({"status": "resolved", "run": run, "kind": kind, "ranks": [], "hosts": [],
                    "count": 0, "message": message, "at": now,
                    "url": run_link(self.public_url, run), "text": text, "content": text})
        return out

    def forget_run(self, run: str) -> None:
        """Drop a run's open groups and repeat memory (the run was evicted from memory)."""
        for key in [k for k in self._groups if k[0] == run]:
            del self._groups[key]
        for key2 in [k for k in self._posted if k[0] == run]:
            del self._posted[key2]

    def _firing(self, run: str, kind: str, group: _Group) -> dict[str, Any]:
        ranks = sorted(group.ranks)
        hosts = sorted(group.hosts)
        return {"status": "firing", "run": run, "kind": kind, "ranks": ranks, "hosts": hosts,
                "count": len(ranks), "message": group.message, "at": group.first_at,
                "url": run_link(self.public_url, run),
                **dict.fromkeys(("text", "content"), chat_line(run, kind, ranks, hosts, group.message))}


def chat_line(run: str, kind: str, ranks: Sequence[int], hosts: Sequence[str], message: str) -> str:
    """One line for chat tools: ``[rankboard] run-7: stalled on 1,023 ranks (node001…): <message>``,
    at most :data:`MAX_TEXT` characters."""
    if not ranks:
        where = ""
    elif len(ranks) == 1:
        where = f" on rank {ranks[0]}"
    else:
        where = f" on {len(ranks):,} ranks"
    if hosts:
        shown = ", ".join(hosts[:_TEXT_HOSTS])
        where += f" ({shown}…)" if len(hosts) > _TEXT_HOSTS else f" ({shown})"
    line = f"[rankboard] {run}: {kind}{where}: {message}"
    return line if len(line) <= MAX_TEXT else line[:MAX_TEXT - 1] + "…"


class _Post(NamedTuple):
    body: bytes
    url: str
    attempt: int  # 0 for the first try


#: ``opener(request, timeout)`` -> HTTP status; raises urllib/socket errors like urlopen.
Opener = Callable[[urllib.request.Request, float], int]


def _urlopen(request: urllib.request.Request, timeout: float) -> int:
    with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310 - http(s) checked
        response.read(65536)  # drain a little so keep-alive servers see a complete exchange
        return int(response.status)


class WebhookNotifier:
    """The broker's webhook thread: groups alerts, POSTs them to every URL, retries, counts.

    Thread-safe: :meth:`alert`, :meth:`run_ended` and :meth:`forget_run` may be called from
    the broker's loop at any rate; they never block on I/O. ``clock`` gives unix seconds
    (grouping windows, retry times and the payloads' ``at``); ``timeout``, ``retry_delays``,
    ``window`` and ``max_queue`` are constructor arguments so tests run in milliseconds.
    The constructor starts nothing; :meth:`start` starts the thread, :meth:`close` stops it.
    """

    def __init__(self, urls: Sequence[str], *, repeat: float = DEFAULT_REPEAT,
                 public_url: str | None = None, window: float = GROUP_WINDOW,
                 timeout: float = TIMEOUT, retry_delays: Sequence[float] = RETRY_DELAYS,
                 max_queue: int = QUEUE_MAX, clock: Callable[[], float] = time.time,
                 opener: Optional[Opener] = None) -> None:
        self.urls = list(urls)
        self.timeout = timeout
        self.retry_delays = tuple(retry_delays)
        self.max_queue = max_queue
        self._clock = clock
        self._open: Opener = opener or _urlopen
        self._grouper = AlertGrouper(window=window, repeat=repeat, public_url=public_url)
        self._cond = threading.Condition(threading.Lock())
        self._queue: deque[_Post] = deque()  # ready now, oldest first
        self._retries: list[tuple[float, int, _Post]] = []  # (not before, seq, post) heap
        self._seq = itertools.count()
        self._closing = False
        self._busy = False  # a POST is in flight
        self._thread: threading.Thread | None = None
        self._rlog = RateLimitedLog(log, 60.0)
        self.sent = 0
        self.failed = 0
        self.dropped = 0

    # -- called from the broker's loop ------------------------------------------------------

    def alert(self, run: str, kind: str, rank: int | None, message: str,
              host: str | None = None, now: float | None = None) -> None:
        """An alert was raised (not replayed). Returns at once."""
        if not self.urls:
            return
        with self._cond:
            if self._closing:
                return
            t = self._clock() if now is None else now
            first = self._grouper.next_due() is None
            if self._grouper.alert(run, kind, rank, message, t, host) and first:
                self._cond.notify()  # the thread learns the new window's end

    def run_ended(self, run: str, status: str, now: float | None = None) -> None:
        """A run completed (``"complete"``) or failed (``"failed"``): its open groups and the
        ``resolved`` POST go out at once."""
        if not self.urls:
            return
        with self._cond:
            if self._closing:
                return
            t = self._clock() if now is None else now
            for payload in self._grouper.run_ended(run, status, t):
                self._enqueue(payload)
            self._cond.notify()

    def forget_run(self, run: str) -> None:
        """The broker evicted ``run``: drop its open groups and repeat memory."""
        with self._cond:
            self._grouper.forget_run(run)

    def counters(self) -> dict[str, int]:
        """``{"sent", "failed", "dropped"}`` for the heartbeat."""
        with self._cond:
            return {"sent": self.sent, "failed": self.failed, "dropped": self.dropped}

    def pending(self) -> int:
        """POSTs queued, waiting to retry or in flight, plus open groups (for tests)."""
        with self._cond:
            return (len(self._queue) + len(self._retries) + int(self._busy)
                    + len(self._grouper._groups))

    # -- the queue (lock held) -----------------------------------------------------------------

    def _enqueue(self, payload: dict[str, Any]) -> None:
        body = json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        for url in self.urls:
            while len(self._queue) + len(self._retries) >= self.max_queue:
                if self._queue:
                    self._queue.popleft()
                else:
                    self._retries.remove(max(self._retries))  # the retry due last goes
                    heapq.heapify(self._retries)
                self.dropped += 1
                self._rlog.warning(("full", url), "webhook queue full: oldest POST to %s dropped",
                                   redact(url))
            self._queue.append(_Post(body, url, 0))

    def _next(self) -> _Post | None:
        """Wait for the next POST to make (flushing due groups meanwhile); None when closing."""
        with self._cond:
            while True:
                now = self._clock()
                for payload in self._grouper.due(now):
                    self._enqueue(payload)
                while self._retries and self._retries[0][0] <= now:
                    self._queue.append(heapq.heappop(self._retries)[2])
                if self._closing:
                    return None
                if self._queue:
                    self._busy = True
                    return self._queue.popleft()
                wake = [t for t in (self._grouper.next_due(),
                                    self._retries[0][0] if self._retries else None) if t is not None]
                self._cond.wait(None if not wake else max(0.0, min(wake) - now) + 0.001)

    # -- the thread ----------------------------------------------------------------------------

    def _attempt(self, post: _Post) -> str:
        """One POST: ``"sent"``, ``"retry"`` (may succeed later) or ``"refused"``."""
        request = urllib.request.Request(
            post.url, data=post.body, method="POST",
            headers={"Content-Type": "application/json", "User-Agent": "rankboard"})
        try:
            status = self._open(request, self.timeout)
        except urllib.error.HTTPError as exc:
            status = exc.code
            exc.close()
        except (OSError, ValueError, http.client.HTTPException) as exc:  # URLError, timeouts,
            # refused, reset, a reply that is not HTTP
            reason = getattr(exc, "reason", exc)
            self._rlog.warning(("error", post.url), "webhook %s: %s", redact(post.url),
                               type(reason).__name__)
            return "retry"
        if 200 <= status < 300:
            return "sent"
        self._rlog.warning(("status", post.url), "webhook %s answered HTTP %d", redact(post.url), status)
        return "retry" if status == 429 or status >= 500 else "refused"

    def _deliver(self, post: _Post) -> None:
        outcome = self._attempt(post)
        with self._cond:
            self._busy = False
            if outcome == "sent":
                self.sent += 1
                return
            self.failed += 1
            if outcome == "retry" and post.attempt < len(self.retry_delays) and not self._closing:
                when = self._clock() + self.retry_delays[post.attempt]
                heapq.heappush(self._retries, (when, next(self._seq), post._replace(attempt=post.attempt + 1)))
                return
            self.dropped += 1

    def _run(self) -> None:
        while True:
            post = self._next()
            if post is None:
                return
            try:
                self._deliver(post)
            except Exception:  # a bug, never a receiver's doing: keep the thread alive
                log.exception("webhook delivery to %s failed unexpectedly", redact(post.url))
                with self._cond:
                    self._busy = False
                    self.dropped += 1

    def start(self) -> WebhookNotifier:
        """Start the delivery thread (a no-op without URLs); returns self."""
        if self.urls and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="rankboard-webhooks", daemon=True)
            self._thread.start()
            log.info("alert webhooks: %s", ", ".join(redact(u) for u in self.urls))
        return self

    def close(self, timeout: float = 1.0) -> None:
        """Stop the thread (waiting at most ``timeout`` for a POST in flight); whatever is
        still queued, waiting to retry or grouped is dropped and counted."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
        with self._cond:
            left = len(self._queue) + len(self._retries)
            left += len(self._grouper._groups) * len(self.urls)
            self._queue.clear()
            self._retries.clear()
            self._grouper._groups.clear()
            self.dropped += left
