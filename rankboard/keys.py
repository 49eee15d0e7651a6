"""``rankboard keys DIR``: the CURVE key pairs of a broker, its ranks and its webs.

Layout written under ``DIR`` (ZeroMQ certificate files, ``zmq.auth.create_certificates``)::

    DIR/server.key                  the broker's public key   -> RANKBOARD_CURVE_SERVER_KEY on ranks
    DIR/server.key_secret           the broker's key pair     -> broker --curve-secret-key (0600)
    DIR/clients/client-N.key_secret a rank's key pair         -> RANKBOARD_CURVE_CLIENT_KEY (0600)
    DIR/clients/client-N.key        its public half
    DIR/webs/web-N.key_secret       a web's key pair  -> rankboard web --curve-client-key (0600)
    DIR/webs/web-N.key              its public half
    DIR/authorized/client-N.key     the public keys the broker accepts -> --curve-authorized
    DIR/authorized/web-N.key        (ranks and webs alike: one directory, one ZAP policy)
    DIR/authorized-webs/web-N.key   the webs' alone -> broker --curve-web-authorized

Why this shape: the secret files are the only things that must stay private, so they are
created with mode 0600 (under a 0077 umask, so they are never readable by others, not even
for an instant) and ``DIR`` itself is 0700 when we create it. ``authorized/`` holds only
public keys, so it can be copied anywhere; revoking a rank (or a web) is deleting its file
there and restarting the broker. Existing files are never overwritten: running the command
again with a larger ``--clients`` or ``--webs`` adds the missing ones and keeps every key
already handed out. Web keys live apart from rank keys (``webs/``) because they go to other
machines (the web hosts, not the training nodes). The broker lets both connect, since its
publish and snapshot sockets demand CURVE with the same authorized directory as ingest, and
tells them apart for one verb: only a key in ``authorized-webs/`` may make ranks dump their
stacks (a rank's key would otherwise make every other job's ranks stop and dump).

The clients' half of the key files (reading them) is :mod:`rank_agent.curve`.
"""
from __future__ import annotations

import logging
import os
import shutil
import sys
from pathlib import Path

__all__ = ["keys_main", "create_keys", "SERVER", "CLIENTS_DIR", "WEBS_DIR", "AUTHORIZED_DIR",
           "AUTHORIZED_WEBS_DIR"]

log = logging.getLogger(__name__)

SERVER = "server"
CLIENTS_DIR = "clients"
WEBS_DIR = "webs"
AUTHORIZED_DIR = "authorized"
AUTHORIZED_WEBS_DIR = "authorized-webs"


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


def create_keys(directory: Path, clients: int = 1, webs: int = 1) -> list[Path]:
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
    webs_dir = directory / WEBS_DIR
    authorized = directory / AUTHORIZED_DIR
    authorized_webs = directory / AUTHORIZED_WEBS_DIR
    for folder in (clients_dir, webs_dir, authorized, authorized_webs):
        public_only = folder in (authorized, authorized_webs)
        folder.mkdir(mode=0o755 if public_only else 0o700, exist_ok=True)
    pairs: list[tuple[Path, str, tuple[Path, ...]]] = [
        (clients_dir, f"client-{n}", (authorized,)) for n in range(1, clients + 1)]
    pairs += [(webs_dir, f"web-{n}", (authorized, authorized_webs)) for n in range(1, webs + 1)]
    for folder, name, copies in pairs:
        public, secret, created = _pair(folder, name)
        if created:
            written += [public, secret]
        for where in copies:
            target = where / public.name
            if not target.exists():
                shutil.copyfile(public, target)
                os.chmod(target, 0o644)
                written.append(target)
    return written


def keys_main(directory: Path, clients: int = 1, webs: int = 1) -> int:
    """``rankboard keys DIR [--clients N] [--webs N]``: prints what it wrote and how to use
    it."""
    directory = Path(directory)
    try:
        written = create_keys(directory, clients, webs)
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
          f" --curve-authorized {d / AUTHORIZED_DIR}"
          f" --curve-web-authorized {d / AUTHORIZED_WEBS_DIR}")
    print(f"ranks:  RANKBOARD_CURVE_SERVER_KEY={d / 'server.key'} "
          f"RANKBOARD_CURVE_CLIENT_KEY={d / CLIENTS_DIR / 'client-1.key_secret'}")
    if webs:
        print(f"web:    rankboard web --curve-server-key {d / 'server.key'} "
              f"--curve-client-key {d / WEBS_DIR / 'web-1.key_secret'}")
    print("keep *.key_secret private; revoke a rank or a web by deleting its file in "
          f"{d / AUTHORIZED_DIR} (and {d / AUTHORIZED_WEBS_DIR}) and restarting the broker")
    return 0
