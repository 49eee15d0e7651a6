"""The parsed command line as typed configs, built once in :func:`from_args` and passed down.

Each layer owns the config of what it runs (:class:`broker.config.BrokerConfig`,
:class:`web.config.WebConfig`: they cannot import this package, which sits above them); this
module adds the two commands that combine them (:class:`UpConfig`, :class:`DemoConfig`) and
is the one place that reads an ``argparse.Namespace``. Every config gives back its own
arguments (``argv()``) for the child processes that ``up``, ``demo`` and ``--workers`` start.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Union

from broker.config import BrokerConfig, default_data_dir
from rank_agent.protocol import DEFAULT_INGEST, DEFAULT_PUBLISH, DEFAULT_SNAPSHOT
from web.config import DEFAULT_WEB_HOST, DEFAULT_WEB_PORT, WebConfig

__all__ = ["BrokerConfig", "DemoConfig", "KeysConfig", "UpConfig", "WebConfig", "from_args",
           "DEFAULT_INGEST", "DEFAULT_PUBLISH", "DEFAULT_SNAPSHOT", "DEFAULT_WEB_HOST",
           "DEFAULT_WEB_PORT", "default_data_dir"]


@dataclass(frozen=True)
class UpConfig:
    """``rankboard up``: a broker child and a web (or a pool of them) reading its feed."""

    broker: BrokerConfig
    web: WebConfig
    #: ``--shards N`` (PROTOCOL 7.3): N brokers (rankboard/shardplan.py), one web over all
    shards: int = 1


@dataclass(frozen=True)
class DemoConfig:
    """``rankboard demo``: ``up`` plus a simulated cluster of real agent processes."""

    up: UpConfig
    ranks: int = 8
    hosts: int = 2
    epochs: int = 20
    epoch_seconds: float = 2.0
    no_browser: bool = False
    rounds: int = 0  # runs of each job, then no new run (0: until Ctrl-C)


@dataclass(frozen=True)
class KeysConfig:
    """``rankboard keys``: CURVE key pairs to have in ``dir``."""

    dir: Path
    clients: int = 1
    webs: int = 1


Config = Union[BrokerConfig, WebConfig, UpConfig, DemoConfig, KeysConfig]


def log_level(args: argparse.Namespace) -> str:
    """``--log-level``, else DEBUG with ``-v``, else INFO."""
    return str(args.log_level or ("DEBUG" if args.verbose else "INFO"))


def _broker(args: argparse.Namespace) -> BrokerConfig:
    return BrokerConfig(
        ingest=args.ingest, publish=args.publish, snapshot=args.snapshot,
        data_dir=args.data_dir, stale_after=args.stale_after,
        step_close_after=args.step_close_after, max_runs=args.max_runs,
        retention_days=args.retention_days, curve_secret_key=args.curve_secret_key,
        curve_authorized=args.curve_authorized,
        curve_web_authorized=args.curve_web_authorized, log_level=log_level(args),
        alert_webhooks=tuple(args.alert_webhook), alert_repeat=args.alert_repeat,
        public_url=args.public_url, shard=getattr(args, "shard", (0, 1)),
        retain_bytes=args.retain_bytes,
        control_secret_file=getattr(args, "control_secret_file", None))


def _web(args: argparse.Namespace, *, with_broker: bool) -> WebConfig:
    """The web of ``web``, or of ``up``/``demo`` (``with_broker``), whose server key
    defaults to the broker's secret key file (the public half is read from it)."""
    server, flag = args.curve_server_key, "--curve-server-key"
    if with_broker and server is None and args.curve_client_key is not None:
        server, flag = args.curve_secret_key, "--curve-secret-key"
    return WebConfig(
        publish=args.publish, snapshot=args.snapshot, host=args.host, port=args.port,
        token=args.token, insecure_no_auth=args.insecure_no_auth,
        curve_server_key=server, curve_client_key=args.curve_client_key,
        curve_server_flag=flag,
        workers=args.workers, metrics_port=args.metrics_port,
        metrics_host=args.metrics_host, worker_id=args.worker_id,
        allowed_hosts=tuple(args.allowed_host), read_only=bool(args.read_only),
        log_level=log_level(args))


def from_args(args: argparse.Namespace) -> Config:
    """The config of ``args.command`` from its parsed flags (see ``rankboard/cli.py``)."""
    if args.command == "broker":
        return _broker(args)
    if args.command == "web":
        return _web(args, with_broker=False)
    if args.command in ("up", "demo"):
        broker, web = _broker(args), _web(args, with_broker=True)
        if broker.curve_web_authorized is None and web.curve_client_key is not None:
            # the broker of up/demo serves its own web: that web's key may ask for dumps
            broker = replace(broker, curve_web_authorized=web.curve_client_key)
        if args.command == "up" and web.port is None and not getattr(args, "port_from_rank", False):
            # PROTOCOL 8.5: the README's address at once; the v1 lazy rule only when asked
            web = replace(web, port=DEFAULT_WEB_PORT)
        up = UpConfig(broker=broker, web=web, shards=getattr(args, "shards", 1))
        if args.command == "up":
            return up
        return DemoConfig(up=up, ranks=args.ranks, hosts=args.hosts, epochs=args.epochs,
                          epoch_seconds=args.epoch_seconds, no_browser=args.no_browser,
                          rounds=args.rounds)
    if args.command == "keys":
        return KeysConfig(dir=args.dir, clients=args.clients, webs=args.webs)
    raise ValueError(f"unknown command {args.command!r}")
