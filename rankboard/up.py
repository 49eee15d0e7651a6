"""The commands that serve a web: ``rankboard web``, ``rankboard up`` and ``rankboard demo``.

* ``web``: one web (``web/serve.py``) or, with ``--workers N``, a supervisor of N worker
  processes (``web/workers.py``), each started as ``python -m rankboard web --worker-id K``.
* ``up``: the broker as a child process (:class:`BrokerChild`, ``python -m rankboard
  broker ...``) plus the web here, bound at once on ``--port`` (default 8585, PROTOCOL 8.5);
  with ``--port-from-rank`` the web binds lazily on the first port a rank registers.
* ``demo``: ``up`` with a private broker on ephemeral loopback ports and a temporary data
  dir, plus a simulated cluster of real agent processes (``rankboard/demo.py``), run after
  run until Ctrl-C.

These live above ``broker/`` and ``web/`` because ``up`` and ``demo`` orchestrate both. Each
command monkey-patches first (:func:`web.serve.patch`); every child is started by
:func:`rankboard.process.child_command`.
"""
from __future__ import annotations

import logging
import os
import re
import shutil
import socket
import sys
import tempfile
import time
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

from broker.config import BrokerConfig, default_data_dir
from rank_agent.controlauth import SECRET_FILE_NAME, trust_summary
from rank_agent.protocol import DEFAULT_INGEST, DEFAULT_PUBLISH, DEFAULT_SNAPSHOT
from rankboard.config import DemoConfig, UpConfig
from rankboard.process import PARENT_ENV, child_command, terminate
from rankboard.shardplan import broker_line, shard_configs, unsharded_runs_note
from web.config import WebConfig
from web.serve import (
    LazyBinder,
    Stopper,
    Web,
    bind_failure,
    bind_refusal,
    dashboard_url,
    fail,
    feed_curve,
    patch,
    port_taken,
    run_web,
    say,
)
from web.workers import WorkerPool, pool_refusal, run_pool

log = logging.getLogger(__name__)

_BOUND = re.compile(r"broker (ingest|publish|snapshot) bound at (\S+)")
_CHILD_FAILURE = re.compile(r"^rankboard broker: (.*)$")
EPHEMERAL = "tcp://127.0.0.1:*"
BROKER_START_TIMEOUT = 20.0
#: what starts a web worker: ``python -m rankboard web ...`` (see :mod:`rankboard.process`)
launch_worker = partial(child_command, "rankboard")


def _check(cfg: WebConfig, prog: str) -> tuple[int | None, dict[int, bytes] | None]:
    """(an exit status if the web cannot start, its CURVE options): the refusal to bind a
    non-loopback host without a token, the ``--workers`` limits and the key files are all
    usage errors (2), found before anything starts."""
    refusal = bind_refusal(cfg.host, cfg.token, cfg.insecure_no_auth) or pool_refusal(cfg)
    if refusal:
        return fail(prog, refusal, 2), None
    try:
        return None, feed_curve(cfg)
    except ValueError as exc:
        return fail(prog, str(exc), 2), None


def web_main(cfg: WebConfig) -> int:
    """``rankboard web``: serve the dashboard of the broker at --publish/--snapshot.

    With ``--workers N`` (N > 1) this process supervises N workers instead; a worker
    (``--worker-id``) is this same command, told by its supervisor to share the port."""
    patch()
    prog = "rankboard web"
    code, curve = _check(cfg, prog)
    if code is not None:
        return code
    if cfg.worker_id is None and cfg.workers > 1:
        return run_pool(cfg, launch_worker, prog)
    return run_web(cfg, curve, prog)


class BrokerChild:
    """``python -m rankboard broker ...`` as a child; relays its log and learns its endpoints."""

    def __init__(self, cfg: BrokerConfig) -> None:
        given = {"ingest": cfg.ingest, "publish": cfg.publish, "snapshot": cfg.snapshot}
        #: ephemeral endpoints are learnt from the child's "bound at" log lines (INFO)
        self.learn = any(ep.endswith(":*") for ep in given.values())
        if self.learn and cfg.log_level not in ("DEBUG", "INFO"):
            cfg = replace(cfg, log_level="INFO")
        self.wait_bound = cfg.log_level in ("DEBUG", "INFO")
        self.cfg = cfg
        self.proc: Any = None
        self.endpoints: dict[str, str] = {} if self.learn else dict(given)
        self._seen: set[str] = set()
        #: the child's own one-line reason for exiting ("rankboard broker: <reason>")
        self.reason: str | None = None

    def start(self, stopper: Stopper) -> str | None:
        """Start the child and wait until it has bound all three sockets.

        Returns None when ready, else a one-line reason (the child's own error is relayed).
        """
        import gevent
        import gevent.event
        from gevent import subprocess

        ready = gevent.event.Event()
        cmd, env = child_command("rankboard", self.cfg.argv())
        env["PYTHONUNBUFFERED"] = "1"
        env[PARENT_ENV] = str(os.getpid())  # the broker ends when we end, even SIGKILLed
        env.update(self.cfg.child_env())  # the webhook URLs: never on a command line
        # a process group of its own: a terminal's Ctrl-C reaches only us, and we stop the
        # broker last, after the demo's ranks and the web, so their last frames still land
        # (it still ends with us, however we end: PARENT_ENV)
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     stdout=subprocess.DEVNULL, env=env,
                                     start_new_session=True)  # (`up` says "shard")

        def relay() -> None:
            assert self.proc is not None
            for raw in self.proc.stderr:
                line = raw.decode("utf-8", "replace")
                failure = _CHILD_FAILURE.match(line)
                if failure:  # becomes our own one-line reason instead of a second line
                    self.reason = failure.group(1).strip()
                    continue
                sys.stderr.write(line)
                sys.stderr.flush()
                m = _BOUND.search(line)
                if m:
                    self._seen.add(m.group(1))
                    if self.learn:
                        self.endpoints[m.group(1)] = m.group(2)
                    if len(self._seen) == 3:
                        ready.set()
            ready.set()  # the child exited

        gevent.spawn(relay)
        if not self.wait_bound:  # its log is quiet: a failed bind shows as its exit instead
            return None
        deadline = time.monotonic() + BROKER_START_TIMEOUT
        while not ready.is_set() and not stopper.stopping and time.monotonic() < deadline:
            ready.wait(0.2)
        if stopper.stopping:
            return None
        if len(self._seen) == 3:
            return None
        try:
            self.proc.wait(timeout=2.0)  # its stderr closed: it is exiting
        except subprocess.TimeoutExpired:
            return f"the broker did not bind within {BROKER_START_TIMEOUT:.0f} s"
        return self.failure()

    def failure(self) -> str:
        """Why the child exited, in one line."""
        code = None if self.proc is None else self.proc.poll()
        if self.reason:
            return f"broker: {self.reason}"
        return f"the broker exited with status {code}"

    def exited(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def stop(self) -> None:
        if self.proc is not None:
            terminate(self.proc)
            if self.proc.stderr is not None:
                self.proc.stderr.close()


def up_main(cfg: UpConfig) -> int:
    """``rankboard up``: the broker (child process) and the web (here)."""
    return _up(cfg, "rankboard up")


def demo_main(cfg: DemoConfig) -> int:
    """``rankboard demo``: ``up`` on private ports plus a simulated cluster, until Ctrl-C."""
    return _up(cfg.up, "rankboard demo", demo=cfg)


def free_port_block(n: int, tries: int = 50) -> int | None:
    """A loopback port P with P .. P + n - 1 all free now (None when none was found): the
    demo's private broker in the default port layout. Another process may still take one
    before the broker binds it; the broker then fails to start with the bind error."""
    for _ in range(tries):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        if base + n > 65536:
            continue
        held: list[socket.socket] = []
        try:
            for port in range(base, base + n):
                sock = socket.socket()
                held.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in held:
                sock.close()
    return None


def _up(cfg: UpConfig, prog: str, *, demo: DemoConfig | None = None) -> int:
    patch()
    code, curve = _check(cfg.web, prog)
    if code is not None:
        return code
    bcfg = cfg.broker
    if demo is not None:  # a private broker: never clash with one already running on the defaults
        defaults = (DEFAULT_INGEST, DEFAULT_PUBLISH, DEFAULT_SNAPSHOT)
        if (bcfg.ingest, bcfg.publish, bcfg.snapshot) == defaults:
            # free ports in the default layout (publish = ingest + 1, snapshot + 2; shard K
            # + 3 K), so the ranks' control channel is the one they derive and nothing warns
            # that it is some other socket (rank_agent.control.squatter_warning)
            base = free_port_block(3 * cfg.shards)
            if base is not None:
                bcfg = replace(bcfg, ingest=f"tcp://127.0.0.1:{base}",
                               publish=f"tcp://127.0.0.1:{base + 1}",
                               snapshot=f"tcp://127.0.0.1:{base + 2}")
        def private(endpoint: str, default: str) -> str:
            return EPHEMERAL if endpoint == default else endpoint

        bcfg = replace(bcfg, ingest=private(bcfg.ingest, DEFAULT_INGEST),
                       publish=private(bcfg.publish, DEFAULT_PUBLISH),
                       snapshot=private(bcfg.snapshot, DEFAULT_SNAPSHOT))
    temp_dir: str | None = None
    if bcfg.data_dir is None:
        if demo is not None:
            temp_dir = tempfile.mkdtemp(prefix="rankboard-demo-")
            bcfg = replace(bcfg, data_dir=Path(temp_dir))
        else:
            bcfg = replace(bcfg, data_dir=default_data_dir())

    if bcfg.control_secret_file is None and bcfg.data_dir is not None:
        # one secret for every shard (a rank reads one), in the top data dir
        bcfg = replace(bcfg, control_secret_file=bcfg.data_dir / SECRET_FILE_NAME)
    try:  # --shards N (PROTOCOL 7.3): N brokers, ports + 3 x K, <data-dir>/shard-K
        bcfgs = shard_configs(bcfg, cfg.shards)
    except ValueError as exc:
        return fail(prog, str(exc), 2)
    if cfg.web.port is not None:  # a port in use: one line, before any broker starts
        taken = port_taken(cfg.web.host, cfg.web.port)
        if taken is not None:
            return fail(prog, bind_failure(taken))
    stopper = Stopper()
    brokers = [BrokerChild(one) for one in bcfgs]
    web: Web | None = None
    cluster: Any = None
    try:
        for child in brokers:
            problem = child.start(stopper)
            if problem:
                return fail(prog, problem)
            if stopper.stopping:
                return 0
        for k in range(len(brokers)):
            say(f"shard {k}/{len(brokers)}")
        note = unsharded_runs_note(bcfg.data_dir, len(brokers))
        if note:
            say(note)
        if len(brokers) > 1 and bcfg.retain_bytes is not None:  # PROTOCOL 8.4
            say(f"--retain-bytes {bcfg.retain_bytes} split evenly: "
                f"{bcfgs[0].retain_bytes} bytes for each shard's data dir")
        if all("ingest" in child.endpoints for child in brokers):
            say(broker_line([child.endpoints["ingest"] for child in brokers]))
        if bcfg.control_secret_file is not None:
            say(control_line(bcfg.control_secret_file,
                             [child.endpoints.get("publish", "?") for child in brokers]))
        wcfg = replace(cfg.web, publish=",".join(b.endpoints["publish"] for b in brokers),
                       snapshot=",".join(b.endpoints["snapshot"] for b in brokers))
        if wcfg.workers > 1:
            return _up_pool(wcfg, prog, brokers, stopper, curve)
        web = Web(wcfg, curve=curve)
        if wcfg.port is None:
            LazyBinder(web).listen(web.hub)
        else:
            try:
                web.bind(wcfg.port)
            except OSError as exc:
                return fail(prog, bind_failure(exc))
        if wcfg.metrics_port is not None:
            try:
                web.bind_metrics(wcfg.metrics_host or wcfg.host, wcfg.metrics_port)
            except OSError as exc:
                return fail(prog, str(exc.strerror or exc))
        web.start_feed()
        if demo is not None:
            from rankboard.demo import Cluster, open_browser

            assert web.port is not None
            cluster = Cluster(  # the ranks get every shard's endpoints, in shard order
                ",".join(b.endpoints["ingest"] for b in brokers), ranks=demo.ranks,
                hosts=demo.hosts, epochs=demo.epochs, epoch_seconds=demo.epoch_seconds,
                port=web.port, control=",".join(b.endpoints["publish"] for b in brokers),
                rounds=demo.rounds, control_secret_file=(
                    None if bcfg.control_secret_file is None else str(bcfg.control_secret_file)),
            )
            cluster.start()
            if not demo.no_browser:
                open_browser(dashboard_url(wcfg.host, web.port))
        while not stopper.wait(0.5):
            gone = _exited(brokers)
            if gone is not None:
                if stopper.wait(0.5):  # the stop reached the broker too (systemd: the whole unit)
                    return 0
                return fail(prog, gone.failure())
        return 0
    finally:
        if cluster is not None:
            cluster.stop()
        if web is not None:
            web.close()
        for child in brokers:
            child.stop()
        stopper.close()
        if temp_dir is not None:
            shutil.rmtree(temp_dir, ignore_errors=True)
            if cluster is not None and cluster.runs_started:
                print(f"{prog}: the demo's runs were in a temporary data dir, now removed; "
                      "`rankboard demo --data-dir DIR` keeps them for "
                      "`rankboard export RUN --data-dir DIR`", file=sys.stderr)
        log.info("%s stopped", prog)


def control_line(secret_file: Path, publishes: list[str]) -> str:
    """The control channel's trust model in one line (issue 38 finding 6): which ranks obey
    only this broker, and what the others obey."""
    return f"control channel: {trust_summary(secret_file, ','.join(publishes))}"


def _exited(brokers: list[BrokerChild]) -> BrokerChild | None:
    """The first broker child that has exited, or None (``up`` owns them all: one gone ends
    it, as one broker's exit always did)."""
    return next((child for child in brokers if child.exited() is not None), None)


def _up_pool(cfg: WebConfig, prog: str, brokers: list[BrokerChild], stopper: Stopper,
             curve: dict[int, bytes] | None) -> int:
    """``up --workers N``: the pool instead of the in-process web, beside the broker child.

    Without ``--port`` the supervisor decides the port exactly as a single web would: a
    hub and feed pump of its own feed :class:`LazyBinder`, which starts the pool on the
    first registered port (and keeps warning about later, different ones). Deciding once,
    here, keeps N workers from ever picking N different ports. (That hub holds a copy of
    the runs, as a worker does: the price of reusing the one implementation of the rule.)
    """
    pool = WorkerPool(cfg, launch_worker)
    feed: Web | None = None
    try:
        if cfg.port is None:
            feed = Web(replace(cfg, workers=1), curve=curve)  # its hubs and pumps, never bound
            LazyBinder(pool).listen(feed.hub)
            feed.start_feed()
        else:
            try:
                pool.bind(cfg.port)
            except OSError as exc:
                return fail(prog, bind_failure(exc))
        while not stopper.wait(0.5):
            if pool.failure:
                return fail(prog, pool.failure)
            gone = _exited(brokers)
            if gone is not None:
                if stopper.wait(0.5):  # the stop reached the broker too (systemd: the whole unit)
                    return 0
                return fail(prog, gone.failure())
            pool.check(stopper)
        return 0
    finally:
        if feed is not None:
            feed.close()
        pool.stop()
