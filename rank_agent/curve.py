"""CURVE for the agent's PUSH socket, configured from the environment.

``RANKBOARD_CURVE_SERVER_KEY``: a file holding the broker's public key (``server.key`` from
``rankboard keys``); ``RANKBOARD_CURVE_CLIENT_KEY``: a file holding this rank's key pair
(``clients/client-N.key_secret``). Both unset: plain ZeroMQ (:func:`socket_options` returns
None).

Policy (why it raises instead of falling back): when keys are configured, the operator asked
for an authenticated, encrypted link. If a key file is missing or unreadable, sending in
plain would leak the run's data to whoever listens and would be refused by a CURVE broker
anyway, so the agent sends **nothing**: :func:`socket_options` raises :class:`CurveError`,
and ``RankAgent`` treats that like an unusable endpoint (one log line, every frame counted
in ``dropped``/``errors``, training never sees an exception).

This module reads files only when called (on the agent's first send), and imports only
``zmq`` (already imported by the agent) and, lazily, ``zmq.auth``.
"""
from __future__ import annotations

import os
from typing import Mapping

import zmq

__all__ = ["CurveError", "socket_options", "SERVER_KEY_ENV", "CLIENT_KEY_ENV"]

SERVER_KEY_ENV = "RANKBOARD_CURVE_SERVER_KEY"
CLIENT_KEY_ENV = "RANKBOARD_CURVE_CLIENT_KEY"


class CurveError(ValueError):
    """CURVE is configured but cannot be used; the message names the variable and file."""


def _load(path: str, var: str, *, secret: bool) -> tuple[bytes, bytes | None]:
    import zmq.auth

    try:
        public, secret_key = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise CurveError(f"{var}={path!r}: cannot read a CURVE key file: {exc}") from None
    if not public or len(public) != 40:
        raise CurveError(f"{var}={path!r}: no CURVE public key in the file")
    if secret and (not secret_key or len(secret_key) != 40):
        raise CurveError(f"{var}={path!r}: no CURVE secret key in the file "
                         "(use the client's .key_secret file)")
    return public, secret_key


def socket_options(env: Mapping[str, str] | None = None) -> dict[int, bytes] | None:
    """ZeroMQ socket options that make a client socket a CURVE client, from ``env``
    (default ``os.environ``); None when neither variable is set.

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
    if not zmq.has("curve"):
        raise CurveError("CURVE keys are configured but this libzmq has no CURVE support")
    server_public, _ = _load(server, SERVER_KEY_ENV, secret=False)
    client_public, client_secret = _load(client, CLIENT_KEY_ENV, secret=True)
    assert client_secret is not None
    return {
        zmq.CURVE_SERVERKEY: server_public,
        zmq.CURVE_PUBLICKEY: client_public,
        zmq.CURVE_SECRETKEY: client_secret,
    }
