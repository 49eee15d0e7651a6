"""``rankboard up --shards N``: the N broker configs and the line the ranks need (PROTOCOL 7.3).

Pure (no processes, no sockets), so the port and directory rules are unit tests: shard K
binds the ``--ingest``, ``--publish`` and ``--snapshot`` ports + 3 × K (an ephemeral ``:*``
stays ephemeral), journals in ``<data-dir>/shard-K`` when N > 1 (one broker keeps its data
dir as it was, so ``up`` without ``--shards`` is unchanged), and runs as ``--shard K/N``.
"""
from __future__ import annotations

import os
import re
import socket
from dataclasses import replace
from typing import Callable

from broker.config import BrokerConfig

__all__ = ["shard_configs", "shift_port", "broker_line", "unsharded_runs_note", "MAX_SHARDS",
           "split_bytes"]

#: ``--shards`` at most (a head node's cores, generously; ports + 3 × K stay in range).
MAX_SHARDS = 64

_TCP = re.compile(r"^(tcp://.*):([0-9]+|\*)$")  # (not \d: it matches any script's digits)
#: hosts a broker may bind that no rank can connect to: printed as the host's name instead
_WILDCARDS = ("*", "0.0.0.0", "[::]", "::")


def shift_port(endpoint: str, by: int) -> str:
    """``endpoint`` with its TCP port + ``by`` (``:*`` unchanged); ValueError for an endpoint
    with no TCP port (``ipc://``: shards need a port each)."""
    m = _TCP.match(endpoint)
    if m is None:
        raise ValueError(f"--shards needs TCP endpoints with a port, got {endpoint!r}")
    if m.group(2) == "*" or by == 0:
        return endpoint
    port = int(m.group(2)) + by
    if port > 65535:
        raise ValueError(f"{endpoint} + {by} is past port 65535")
    return f"{m.group(1)}:{port}"


def shard_configs(cfg: BrokerConfig, shards: int) -> list[BrokerConfig]:
    """The config of each of ``shards`` brokers, shard 0 first (module docstring)."""
    if shards == 1:
        return [cfg]
    out = []
    for k in range(shards):
        out.append(replace(
            cfg, ingest=shift_port(cfg.ingest, 3 * k), publish=shift_port(cfg.publish, 3 * k),
            snapshot=shift_port(cfg.snapshot, 3 * k), shard=(k, shards),
            data_dir=cfg.data_dir / f"shard-{k}" if cfg.data_dir is not None else None,
            retain_bytes=split_bytes(cfg.retain_bytes, shards)))
    return out


def split_bytes(total: int | None, shards: int) -> int | None:
    """PROTOCOL 8.4: each of ``shards`` brokers bounds its own data dir by ``total`` ÷ N
    (whole bytes, at least 1; None: no bound)."""
    return None if total is None else max(1, total // shards)


def broker_line(ingests: list[str], hostname: Callable[[], str] = socket.gethostname) -> str:
    """``RANKBOARD_BROKER=<list>``: the bound ingest endpoints, shard 0 first, a wildcard
    address replaced by this host's name (a rank cannot connect to ``*``)."""
    shown = []
    for endpoint in ingests:
        m = _TCP.match(endpoint)
        if m is not None:
            host = m.group(1)[len("tcp://"):]
            if host in _WILDCARDS:
                endpoint = f"tcp://{hostname()}:{m.group(2)}"
        shown.append(endpoint)
    return "RANKBOARD_BROKER=" + ",".join(shown)


def unsharded_runs_note(data_dir: str | os.PathLike[str] | None, shards: int) -> str | None:
    """What to say when ``up --shards N`` (N > 1) starts on a data dir that an unsharded
    broker journaled into (``<data-dir>/runs``): the shards journal in ``shard-K``, so those
    runs would vanish from the dashboard without a word. They are not moved (a run's shard
    is a hash of its id; moving journals between dirs is an admin's decision), and
    ``rankboard export`` still reads them; None when there is nothing to say."""
    if shards <= 1 or data_dir is None:
        return None
    runs = os.path.join(os.fspath(data_dir), "runs")
    try:
        count = sum(1 for name in os.listdir(runs) if name.endswith(".journal"))
    except OSError:
        return None
    if count == 0:
        return None
    return (f"note: {runs} holds {count} run(s) of an unsharded broker, which --shards "
            f"{shards} does not serve (its shards journal in shard-K); `rankboard export RUN "
            f"--data-dir {os.fspath(data_dir)}` still reads them, and `rankboard up` without "
            f"--shards serves them")

