"""What a web process is told: :class:`WebConfig`, built once from the command line.

The command line itself lives above (``rankboard/cli.py``); this layer only knows the values.
:meth:`WebConfig.argv` gives back the ``web ...`` arguments of a child process because a
``--workers N`` supervisor starts its workers as processes: the flags are written out from
the typed values here, in one place. The token never goes on a command line (anyone can read
those in ``ps``): :meth:`WebConfig.env` carries it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

from rank_agent.protocol import DEFAULT_PUBLISH, DEFAULT_SNAPSHOT
from rank_agent.shards import split_endpoints

__all__ = ["DEFAULT_WEB_HOST", "DEFAULT_WEB_PORT", "WebConfig", "FeedError", "feed_pairs"]

DEFAULT_WEB_HOST = "127.0.0.1"
DEFAULT_WEB_PORT = 8585


class FeedError(ValueError):
    """``--publish``/``--snapshot`` lists that do not pair up (a one-line CLI error)."""


def feed_pairs(publish: str, snapshot: str) -> list[tuple[str, str]]:
    """The (publish, snapshot) endpoints of each shard, shard 0 first, from the two
    comma-separated lists (PROTOCOL 7.3: a web over N brokers); :class:`FeedError` when a
    list has a blank item or the two differ in length."""
    try:
        pubs, snaps = split_endpoints(publish), split_endpoints(snapshot)
    except ValueError as exc:
        raise FeedError(str(exc)) from None
    if len(pubs) != len(snaps):
        raise FeedError(f"--publish lists {len(pubs)} endpoint(s) and --snapshot "
                        f"{len(snaps)}: give one of each per shard, in the same order")
    return list(zip(pubs, snaps))


@dataclass(frozen=True)
class WebConfig:
    """Every setting of ``rankboard web`` (and of the web inside ``up``/``demo``)."""

    publish: str = DEFAULT_PUBLISH
    snapshot: str = DEFAULT_SNAPSHOT
    host: str = DEFAULT_WEB_HOST
    #: None: bind lazily on the first port a rank registers (``up`` only)
    port: int | None = DEFAULT_WEB_PORT
    token: str | None = None
    insecure_no_auth: bool = False
    #: the broker's public key file; ``up``/``demo`` default it to their broker's secret key
    #: file (whose public half it holds), see :attr:`curve_server_flag`
    curve_server_key: Path | None = None
    curve_client_key: Path | None = None
    #: the flag :attr:`curve_server_key` came from, named in errors about that file
    curve_server_flag: str = "--curve-server-key"
    workers: int = 1
    metrics_port: int | None = None
    metrics_host: str | None = None
    #: this process's slot in a ``--workers`` pool (None: a web on its own, or a supervisor)
    worker_id: int | None = None
    #: ``--allowed-host``: names a web without a token answers besides loopback and its
    #: bound address (PROTOCOL 4 "Hardening", for a proxy)
    allowed_hosts: tuple[str, ...] = ()
    #: ``--read-only``: refuse ``POST /stacks`` (403) and show no request buttons
    read_only: bool = False
    log_level: str = "INFO"

    def argv(self) -> list[str]:
        """``web --publish ...``: the arguments that make a child process this web."""
        cmd = ["web", "--publish", self.publish, "--snapshot", self.snapshot,
               "--host", self.host]
        if self.port is not None:
            cmd += ["--port", str(self.port)]
        if self.insecure_no_auth:
            cmd.append("--insecure-no-auth")
        if self.curve_server_key is not None:
            cmd += ["--curve-server-key", str(self.curve_server_key)]
        if self.curve_client_key is not None:
            cmd += ["--curve-client-key", str(self.curve_client_key)]
        if self.workers != 1:
            cmd += ["--workers", str(self.workers)]
        if self.metrics_port is not None:
            cmd += ["--metrics-port", str(self.metrics_port)]
        if self.metrics_host is not None:
            cmd += ["--metrics-host", self.metrics_host]
        if self.worker_id is not None:
            cmd += ["--worker-id", str(self.worker_id)]
        for name in self.allowed_hosts:
            cmd += ["--allowed-host", name]
        if self.read_only:
            cmd.append("--read-only")
        return cmd + ["--log-level", self.log_level]

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """The environment of a child process that is this web: ``base`` (default ours) with
        ``RANKBOARD_TOKEN`` set to the token, or removed when there is none."""
        env = dict(os.environ if base is None else base, PYTHONUNBUFFERED="1")
        env.pop("RANKBOARD_TOKEN", None)
        if self.token:
            env["RANKBOARD_TOKEN"] = self.token
        return env

    def worker(self, slot: int, port: int) -> WebConfig:
        """The config of worker ``slot`` (1..N) of this web's pool, serving ``port``.

        ``--metrics-port P`` becomes P+slot-1 for each worker (0: each its own ephemeral
        port), on ``--metrics-host`` or else the web's host."""
        metrics_port = self.metrics_port
        if metrics_port:
            metrics_port += slot - 1
        return replace(self, port=port, workers=1, worker_id=slot, metrics_port=metrics_port,
                       metrics_host=(self.metrics_host or self.host)
                       if metrics_port is not None else None)
