"""``rankboard keys DIR``: the CURVE key pairs of a broker and its ranks.

Layout written under ``DIR`` (ZeroMQ certificate files, ``zmq.auth.create_certificates``)::

    DIR/server.key                  the broker's public key   -> RANKBOARD_CURVE_SERVER_KEY on ranks
    DIR/server.key_secret           the broker's key pair     -> broker --curve-secret-key (0600)
    DIR/clients/client-N.key_secret a rank's key pair         -> RANKBOARD_CURVE_CLIENT_KEY (0600)
    DIR/clients/client-N.key        its public half
    DIR/authorized/client-N.key     the public keys the broker accepts -> --curve-authorized

Why this shape: the secret files are the only things that must stay private, so they are
created with mode 0600 (under a 0077 umask, so they are never readable by others, not even
for an instant) and ``DIR`` itself is 0700 when we create it. ``authorized/`` holds only
public keys, so it can be copied anywhere; revoking a rank is deleting its file there and
restarting the broker. Existing files are never overwritten: running the command again with
a larger ``--clients`` adds the missing clients and keeps every key already handed out.
"""
from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
from pathlib import Path

__all__ = ["keys_main", "create_keys", "SERVER", "CLIENTS_DIR", "AUTHORIZED_DIR"]

log = logging.getLogger(__name__)

SERVER = "server"
CLIENTS_DIR = "clients"
AUTHORIZED_DIR = "authorized"


def _pair(folder: Path, name: str) -> tuple[Path, Path, bool]:
    """(public file, secret file, created) for ``name`` in ``folder``; kept if it exists."""
    import zmq.auth

    public, secret = folder / f"{name}.key", folder / f"{name}.key_secret"
    if secret.exists():
        return public, secret, False
    old = os.umask(0o077)  # the secret is private from the first byte written
    try:
        pub, sec = zmq.auth.create_certificates(str(folder), name)
    finally:
        os.umask(old)
    os.chmod(sec, 0o600)
    os.chmod(pub, 0o644)
    return Path(pub), Path(sec), True


def create_keys(directory: Path, clients: int = 1) -> list[Path]:
    """Create (or complete) the layout in ``directory``; returns the files written.

    Raises ``OSError`` (no permission, not a directory) and ``RuntimeError`` when this
    libzmq has no CURVE support.
    """
    import zmq

    if not zmq.has("curve"):
        raise RuntimeError("this libzmq was built without CURVE support")
    directory = Path(directory)
    if not directory.exists():
        directory.mkdir(mode=0o700, parents=True)
    elif not directory.is_dir():
        raise NotADirectoryError(20, "Not a directory", str(directory))
    written: list[Path] = []
    _, server_secret, created = _pair(directory, SERVER)
    if created:
        written += [directory / f"{SERVER}.key", server_secret]
    clients_dir = directory / CLIENTS_DIR
    authorized = directory / AUTHORIZED_DIR
    for folder in (clients_dir, authorized):
        folder.mkdir(mode=0o700 if folder is clients_dir else 0o755, exist_ok=True)
    for n in range(1, clients + 1):
        name = f"client-{n}"
        public, secret, created = _pair(clients_dir, name)
        if created:
            written += [public, secret]
        target = authorized / public.name
        if not target.exists():
            shutil.copyfile(public, target)
            os.chmod(target, 0o644)
            written.append(target)
    return written


def keys_main(args: argparse.Namespace) -> int:
    """``rankboard keys DIR [--clients N]``: prints what it wrote and how to use it."""
    directory = Path(args.dir)
    clients = int(getattr(args, "clients", 1) or 1)
    try:
        written = create_keys(directory, clients)
    except RuntimeError as exc:
        print(f"rankboard keys: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        where = exc.filename or directory
        print(f"rankboard keys: cannot write keys in {where}: {exc.strerror or exc}",
              file=sys.stderr)
        return 1
    for path in written:
        print(f"wrote {path}")
    if not written:
        print(f"{directory}: every key already exists (nothing written)")
    d = directory
    print(f"broker: rankboard broker --ingest tcp://*:5585 --curve-secret-key {d / 'server.key_secret'}"
          f" --curve-authorized {d / AUTHORIZED_DIR}")
    print(f"ranks:  RANKBOARD_CURVE_SERVER_KEY={d / 'server.key'} "
          f"RANKBOARD_CURVE_CLIENT_KEY={d / CLIENTS_DIR / 'client-1.key_secret'}")
    print("keep *.key_secret private; revoke a rank by deleting its file in "
          f"{d / AUTHORIZED_DIR} and restarting the broker")
    return 0
