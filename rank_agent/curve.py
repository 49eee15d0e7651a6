"""CURVE key files, read once for every side: the agent, the web and the broker.

The agent is configured from the environment: ``RANKBOARD_CURVE_SERVER_KEY``, a file holding
the broker's public key (``server.key`` from ``rankboard keys``), and
``RANKBOARD_CURVE_CLIENT_KEY``, a file holding this rank's key pair
(``clients/client-N.key_secret``). Both unset: plain ZeroMQ (:func:`socket_options` returns
None). The web passes its flags' files to :func:`client_options`; the broker reads its own
pair with :func:`load_key` and the webs' public keys with :func:`load_public_keys`. Every
problem is a :class:`CurveError` in one dialect: ``<flag or variable> <file>: <reason>``.

Policy (why the agent raises instead of falling back): when keys are configured, the
operator asked for an authenticated, encrypted link. If a key file is missing or unreadable,
sending in plain would leak the run's data to whoever listens and would be refused by a
CURVE broker anyway, so the agent sends **nothing**: :func:`socket_options` raises
:class:`CurveError`, and ``RankAgent`` treats that like an unusable endpoint (one log line,
every frame counted in ``dropped``/``errors``, training never sees an exception).

This module reads files only when called (on the agent's first send), and imports only
``zmq`` (already imported by the agent) and, lazily, ``zmq.auth``.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping, Union

import zmq

__all__ = ["CurveError", "socket_options", "client_options", "load_key", "load_public_keys",
           "SERVER_KEY_ENV", "CLIENT_KEY_ENV"]

SERVER_KEY_ENV = "RANKBOARD_CURVE_SERVER_KEY"
CLIENT_KEY_ENV = "RANKBOARD_CURVE_CLIENT_KEY"

PathLike = Union[str, Path]


class CurveError(ValueError):
    """CURVE is configured but cannot be used; the message names the flag (or variable)
    and the file."""


def load_key(path: PathLike, label: str, *, secret: bool) -> tuple[bytes, bytes | None]:
    """(public key, secret key or None) of a ZeroMQ certificate file, both z85; ``label``
    (the flag or variable that named the file) starts every error. ``secret``: the file
    must hold the secret half too (a ``.key_secret`` file)."""
    import zmq.auth

    try:
        public, secret_key = zmq.auth.load_certificate(str(path))
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "strerror", None) or exc
        raise CurveError(f"{label} {path}: cannot read a CURVE key file: {reason}") from None
    if not public or len(public) != 40:
        raise CurveError(f"{label} {path}: no CURVE public key in the file")
    if secret and (not secret_key or len(secret_key) != 40):
        raise CurveError(f"{label} {path}: no CURVE secret key in the file "
                         "(use a .key_secret file)")
    return public, secret_key


def load_public_keys(path: PathLike, label: str) -> frozenset[str]:
    """The z85 public keys of the ``*.key`` files in directory ``path``, or of the one key
    file ``path`` (as ZeroMQ's ZAP handler names a client: its ``User-Id``)."""
    import zmq.auth

    if not Path(path).is_dir():
        return frozenset([load_key(path, label, secret=False)[0].decode("ascii")])
    try:
        keys = zmq.auth.load_certificates(str(path))
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "strerror", None) or exc
        raise CurveError(f"{label} {path}: cannot read CURVE key files: {reason}") from None
    return frozenset(key.decode("ascii") for key in keys)


def client_options(server_key: PathLike, client_key: PathLike, *,
                   server_label: str = "--curve-server-key",
                   client_label: str = "--curve-client-key") -> dict[int, bytes]:
    """The ZeroMQ options that make a socket a CURVE client of the broker: the broker's
    public key from ``server_key`` (``server.key``, or the broker's own ``.key_secret``,
    which holds the public half too) and this client's pair from ``client_key``.

    Raises :class:`CurveError` (a ``ValueError``) with a one-line reason naming the label
    and the file. Read once at start, so a bad file stops the command instead of a client
    that silently never connects."""
    if not zmq.has("curve"):
        raise CurveError("CURVE keys are configured but this libzmq has no CURVE support")
    server_public, _ = load_key(server_key, server_label, secret=False)
    public, secret = load_key(client_key, client_label, secret=True)
    assert secret is not None
    return {zmq.CURVE_SERVERKEY: server_public, zmq.CURVE_PUBLICKEY: public,
            zmq.CURVE_SECRETKEY: secret}


def socket_options(env: Mapping[str, str] | None = None) -> dict[int, bytes] | None:
    """The agent's CURVE client options, from ``env`` (default ``os.environ``); None when
    neither variable is set.

    Raises :class:`CurveError` when only one is set, a file cannot be read or holds no key,
    or this libzmq lacks CURVE: the caller must then send nothing (see module docstring).
    """
    env = os.environ if env is None else env
    server = env.get(SERVER_KEY_ENV, "").strip()
    client = env.get(CLIENT_KEY_ENV, "").strip()
    if not server and not client:
        return None
    if not server or not client:
        missing = SERVER_KEY_ENV if not server else CLIENT_KEY_ENV
        raise CurveError(f"CURVE half configured: {missing} is not set (set both, or neither)")
    return client_options(server, client, server_label=SERVER_KEY_ENV,
                          client_label=CLIENT_KEY_ENV)
