"""Alert webhooks (PROTOCOL.md section 3.1, v3): an alert at 3 a.m. reaches a chat channel.

Two parts, as everywhere in the broker:

* :class:`AlertGrouper` is **pure** (an injected ``now`` in every call, no I/O): it groups the
  alerts of one (run, kind) raised within ``window`` seconds of the first of them into **one**
  payload when that window ends (1,024 ranks going stale at once are one message), suppresses
  a (run, kind, rank) already posted until ``repeat`` seconds have passed (and it is raised
  again), and builds the ``resolved`` payload of a run that ended.
* :class:`WebhookNotifier` is the shell: **one daemon thread per URL** (issue 32, finding 6:
  one thread for all let a trickling receiver stop every delivery for 62 s), each flushing the
  grouper's due groups into every URL's queue and POSTing its own. The broker's loop only
  calls :meth:`~WebhookNotifier.alert` and :meth:`~WebhookNotifier.run_ended`, which take a
  lock for a few microseconds and return (**delivery never slows ingest**); all waiting
  (grouping windows, HTTP, retry delays) happens on the threads. Each URL's POSTs wait in a
  queue bounded by count (1,000) and bytes (:data:`QUEUE_BYTES`; beyond either the oldest is
  dropped); each attempt has **one 5 s deadline** for all of it (:mod:`broker.webhooks.post`:
  a receiver trickling bytes cannot stretch it), redirects are refused, and a connection
  error, a timeout, a 5xx or a 429 is retried after 1, 2 and 4 s; a retry waits in the queue
  without holding the thread. One slow receiver delays only its own URL.

A body names at most :data:`MAX_BODY_RANKS` ranks and :data:`MAX_BODY_HOSTS` hosts (the
first, sorted; ``count`` is every rank's), so one POST of 65,536 ranks with long host names
is kilobytes, not 16.6 MiB (finding 7). The chat line neutralises mentions and links from
untrusted strings (``@everyone``, ``<!channel>``, ``<@id>``, ``http://``: a zero-width space
breaks each) and the body carries Discord's ``allowed_mentions: {"parse": []}``.

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

from broker.webhooks import post as webhookhttp
from rank_agent.ratelimit import RateLimitedLog

log = logging.getLogger(__name__)

#: Seconds alerts of one (run, kind) are gathered before their one POST goes out.
GROUP_WINDOW = 5.0
#: ``--alert-repeat`` default: a (run, kind, rank) is posted again only after this long.
DEFAULT_REPEAT = 3600.0
#: POSTs waiting at most per URL (beyond: the oldest is dropped, counted).
QUEUE_MAX = 1000
#: Body bytes waiting at most per URL (beyond: the oldest is dropped, counted).
QUEUE_BYTES = 16 * 1024 * 1024
#: Ranks and hosts one body lists at most (the first, sorted; ``count`` counts all ranks).
MAX_BODY_RANKS = 1024
MAX_BODY_HOSTS = 256
#: Seconds one attempt may take, all of it (connect, send, and the answer's head).
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
            userinfo = parts.username is not None or parts.password is not None
        except ValueError:
            ok, userinfo = False, False
        if not ok:
            raise ValueError(f"alert webhook {redact(url)} is not an http(s) URL with a host")
        if userinfo:  # sent in the clear to whatever the URL resolves to, logged nowhere
            raise ValueError(f"alert webhook {redact(url)} has user:password@ in it: "
                             "not supported (put the secret in the path, as Slack and Discord do)")
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
        text = neutralise(text)
        out.append({"status": "resolved", "run": run, "kind": kind, "ranks": [], "hosts": [],
                    "count": 0, "message": message, "at": now,
                    "url": run_link(self.public_url, run), "text": text, "content": text,
                    "allowed_mentions": {"parse": []}})
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
        line = chat_line(run, kind, ranks, hosts, group.message)
        return {"status": "firing", "run": run, "kind": kind, "ranks": ranks[:MAX_BODY_RANKS],
                "hosts": hosts[:MAX_BODY_HOSTS], "count": len(ranks), "message": group.message,
                "at": group.first_at, "url": run_link(self.public_url, run),
                "text": line, "content": line, "allowed_mentions": {"parse": []}}


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
    line = neutralise(f"[rankboard] {run}: {kind}{where}: {message}")
    return line if len(line) <= MAX_TEXT else line[:MAX_TEXT - 1] + "…"


_ZWSP = "\u200b"
#: untrusted text -> what chat tools show as text, not as a mention or a link
_NEUTRAL = (("@", "@" + _ZWSP), ("<", "<" + _ZWSP), ("://", ":" + _ZWSP + "//"))


def neutralise(text: str) -> str:
    """``text`` with every mention and link a chat tool would act on broken by a zero-width
    space: ``@everyone``/``@here`` (Discord), ``<!channel>``/``<@U1>``/``<url|label>``
    (Slack), and bare ``scheme://`` links (both). It reads the same to a person."""
    for raw, safe in _NEUTRAL:
        if raw in text:
            text = text.replace(raw, safe)
    return text


class _Post(NamedTuple):
    body: bytes
    url: str
    attempt: int  # 0 for the first try


#: ``opener(request, timeout)`` -> HTTP status; raises urllib/socket errors like urlopen.
Opener = Callable[[urllib.request.Request, float], int]


class _Lane:
    """One URL's queue, retries and thread (the notifier's lock guards the fields)."""

    __slots__ = ("url", "queue", "retries", "bytes", "busy", "thread")

    def __init__(self, url: str) -> None:
        self.url = url
        self.queue: deque[_Post] = deque()  # ready now, oldest first
        self.retries: list[tuple[float, int, _Post]] = []  # (not before, seq, post) heap
        #: body bytes queued or waiting to retry
        self.bytes = 0
        self.busy = False  # a POST is in flight
        self.thread: threading.Thread | None = None

    def __len__(self) -> int:
        return len(self.queue) + len(self.retries)


class WebhookNotifier:
    """The broker's webhook threads: groups alerts, POSTs them to every URL (a thread per
    URL), retries, counts.

    Thread-safe: :meth:`alert`, :meth:`run_ended` and :meth:`forget_run` may be called from
    the broker's loop at any rate; they never block on I/O. ``clock`` gives unix seconds
    (grouping windows, retry times and the payloads' ``at``); ``timeout``, ``retry_delays``,
    ``window``, ``max_queue`` and ``max_queue_bytes`` are constructor arguments so tests run
    in milliseconds. The constructor starts nothing; :meth:`start` starts the threads,
    :meth:`close` stops them.
    """

    def __init__(self, urls: Sequence[str], *, repeat: float = DEFAULT_REPEAT,
                 public_url: str | None = None, window: float = GROUP_WINDOW,
                 timeout: float = TIMEOUT, retry_delays: Sequence[float] = RETRY_DELAYS,
                 max_queue: int = QUEUE_MAX, max_queue_bytes: int = QUEUE_BYTES,
                 clock: Callable[[], float] = time.time,
                 opener: Optional[Opener] = None) -> None:
        self.urls = list(urls)
        self.timeout = timeout
        self.retry_delays = tuple(retry_delays)
        self.max_queue = max_queue
        self.max_queue_bytes = max_queue_bytes
        self._clock = clock
        self._open: Opener = opener or webhookhttp.post
        self._grouper = AlertGrouper(window=window, repeat=repeat, public_url=public_url)
        self._cond = threading.Condition(threading.Lock())
        self._lanes = [_Lane(url) for url in self.urls]
        self._seq = itertools.count()
        self._closing = False
        self._rlog = RateLimitedLog(log, 60.0)
        self.sent = 0
        self.failed = 0
        self.dropped = 0

    @property
    def _thread(self) -> threading.Thread | None:
        """The first URL's thread (None: not started)."""
        return self._lanes[0].thread if self._lanes else None

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
                self._cond.notify_all()  # the threads learn the new window's end

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
            self._cond.notify_all()

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
            return (sum(len(lane) + int(lane.busy) for lane in self._lanes)
                    + len(self._grouper._groups))

    def queued_bytes(self) -> int:
        """Body bytes queued or waiting to retry, over every URL (for tests)."""
        with self._cond:
            return sum(lane.bytes for lane in self._lanes)

    # -- the queues (lock held) ----------------------------------------------------------------

    def _enqueue(self, payload: dict[str, Any]) -> None:
        body = json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        for lane in self._lanes:
            while lane and (len(lane) >= self.max_queue
                            or lane.bytes + len(body) > self.max_queue_bytes):
                if lane.queue:
                    gone = lane.queue.popleft()
                else:
                    last = max(lane.retries)  # the retry due last goes
                    lane.retries.remove(last)
                    heapq.heapify(lane.retries)
                    gone = last[2]
                lane.bytes -= len(gone.body)
                self.dropped += 1
                self._rlog.warning(("full", lane.url), "webhook queue full: oldest POST to %s "
                                   "dropped", redact(lane.url))
            lane.queue.append(_Post(body, lane.url, 0))
            lane.bytes += len(body)

    def _next(self, lane: _Lane) -> _Post | None:
        """Wait for the lane's next POST (flushing due groups meanwhile); None when closing."""
        with self._cond:
            while True:
                now = self._clock()
                due = self._grouper.due(now)
                for payload in due:
                    self._enqueue(payload)
                if due:
                    self._cond.notify_all()  # the other URLs' threads have POSTs too
                while lane.retries and lane.retries[0][0] <= now:
                    lane.queue.append(heapq.heappop(lane.retries)[2])
                if self._closing:
                    return None
                if lane.queue:
                    lane.busy = True
                    post = lane.queue.popleft()
                    lane.bytes -= len(post.body)
                    return post
                wake = [t for t in (self._grouper.next_due(),
                                    lane.retries[0][0] if lane.retries else None) if t is not None]
                self._cond.wait(None if not wake else max(0.0, min(wake) - now) + 0.001)

    # -- the threads ---------------------------------------------------------------------------

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
            # the deadline, refused, reset, a reply that is not HTTP
            reason = getattr(exc, "reason", exc)
            self._rlog.warning(("error", post.url), "webhook %s: %s", redact(post.url),
                               type(reason).__name__)
            return "retry"
        if 200 <= status < 300:
            return "sent"
        self._rlog.warning(("status", post.url), "webhook %s answered HTTP %d%s", redact(post.url),
                           status, " (redirects are not followed)" if 300 <= status < 400 else "")
        return "retry" if status == 429 or status >= 500 else "refused"

    def _deliver(self, lane: _Lane, post: _Post) -> None:
        outcome = self._attempt(post)
        with self._cond:
            lane.busy = False
            if outcome == "sent":
                self.sent += 1
                return
            self.failed += 1
            if outcome == "retry" and post.attempt < len(self.retry_delays) and not self._closing:
                when = self._clock() + self.retry_delays[post.attempt]
                heapq.heappush(lane.retries, (when, next(self._seq),
                                              post._replace(attempt=post.attempt + 1)))
                lane.bytes += len(post.body)
                return
            self.dropped += 1

    def _run(self, lane: _Lane) -> None:
        while True:
            post = self._next(lane)
            if post is None:
                return
            try:
                self._deliver(lane, post)
            except Exception:  # a bug, never a receiver's doing: keep the thread alive
                log.exception("webhook delivery to %s failed unexpectedly", redact(post.url))
                with self._cond:
                    lane.busy = False
                    self.dropped += 1

    def start(self) -> WebhookNotifier:
        """Start a delivery thread per URL (a no-op without URLs); returns self."""
        started = False
        for i, lane in enumerate(self._lanes):
            if lane.thread is None:
                lane.thread = threading.Thread(target=self._run, args=(lane,),
                                               name=f"rankboard-webhooks-{i}", daemon=True)
                lane.thread.start()
                started = True
        if started:
            log.info("alert webhooks: %s", ", ".join(redact(u) for u in self.urls))
        return self

    def close(self, timeout: float = 1.0) -> None:
        """Stop the threads (waiting at most ``timeout`` in all for POSTs in flight);
        whatever is still queued, waiting to retry or grouped is dropped and counted."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        end = time.monotonic() + timeout
        for lane in self._lanes:
            if lane.thread is not None:
                lane.thread.join(max(0.0, end - time.monotonic()))
        with self._cond:
            left = sum(len(lane) for lane in self._lanes)
            left += len(self._grouper._groups) * len(self.urls)
            for lane in self._lanes:
                lane.queue.clear()
                lane.retries.clear()
                lane.bytes = 0
            self._grouper._groups.clear()
            self.dropped += left
