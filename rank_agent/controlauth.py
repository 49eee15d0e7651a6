"""The control channel's trust: requests signed by the broker, checked by the agents.

Why (issue 38, finding 6): without CURVE nothing tells an agent who publishes at its control
endpoint. During a broker restart any local process could bind the publish port first and
the agents obeyed it (dumps and profiles answered), and ``rankboard up`` then failed with
"address in use". CURVE authenticates the server, but a loopback deployment has no keys. So
the broker signs each request with a secret that only it and the agents of its user can
read, and an agent that holds the secret obeys nothing else:

* **The secret** is a line of text (at least :data:`MIN_SECRET_CHARS` characters) in a file:
  by default ``<data dir>/control.secret``, which the broker creates at its first start
  (mode ``0600``, 32 random bytes as hex, under a ``0077`` umask so it is never readable by
  others even briefly) and reads at every later one, so it survives restarts. The broker
  takes ``--control-secret-file``/``RANKBOARD_CONTROL_SECRET_FILE`` instead. An agent reads
  ``RANKBOARD_CONTROL_SECRET`` (the text), else ``RANKBOARD_CONTROL_SECRET_FILE``, else,
  when its control endpoint is the default one (``rankboard up``'s publish endpoint,
  ``tcp://127.0.0.1:5586``), the default data dir's file (``$XDG_STATE_HOME/rankboard`` or
  ``~/.local/state/rankboard``: the same rule as ``broker.config.default_data_dir``, which a
  test keeps equal) when it exists: a rank on the broker's host, as its user, with ``rankboard
  up``'s defaults needs no configuration at all. A rank of another broker (another endpoint:
  a second broker with its own ``--data-dir``, a test's) never reads the default broker's
  secret, so it is not made to refuse its own broker's requests.
* **The signature**: the broker re-encodes the request with two keys more, ``t`` (its unix
  time) and ``mac`` (last; 32 bytes): HMAC-SHA256 over :data:`DOMAIN`, the topic, a zero
  byte and the body up to the MAC's 32 bytes. The MAC is the body's tail, so the agent
  checks the very bytes it received, never a re-encoding of them.
* **Replays**: an agent accepts a signed request only within :data:`WINDOW_S` of its own
  clock (``stale`` otherwise) and only once (``replayed``: the MACs accepted within the
  window are remembered, at most :data:`MAX_SEEN`). A captured request replayed later, by a
  process that subscribed to the feed and then squats the port, is refused.
* **Mixed versions** (the wire stays compatible): a broker with a secret and an agent with
  none (an older agent, another host or user) work as before: the extra keys are unknown
  fields, which the request type ignores. An agent with a secret refuses every unsigned
  request (``unsigned``), whoever sends it: an older broker included, whose requests are then
  not answered (the agent says why once a minute). A secret that is configured but cannot be
  used (a missing file, too short) leaves the agent's channel closed rather than open to
  anyone, as unusable CURVE keys do.

Pure but for :func:`agent_secret`'s and :func:`broker_secret`'s file reads; only the standard
library and msgspec, so the agent imports it (no gevent, Flask or torch).
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path
from typing import Dict, Mapping, Optional, Tuple

import msgspec

from .controlwire import ControlRequest, control_topic
from .protocol import DEFAULT_PUBLISH

__all__ = [
    "SECRET_ENV",
    "SECRET_FILE_ENV",
    "SECRET_FILE_NAME",
    "MIN_SECRET_CHARS",
    "MAX_SECRET_BYTES",
    "WINDOW_S",
    "MAX_SEEN",
    "REFUSALS",
    "SecretError",
    "default_secret_file",
    "read_secret",
    "agent_secret",
    "broker_secret",
    "sign_request",
    "trust_summary",
    "Verifier",
]

SECRET_ENV = "RANKBOARD_CONTROL_SECRET"
SECRET_FILE_ENV = "RANKBOARD_CONTROL_SECRET_FILE"
#: The secret's file name in a broker's data dir.
SECRET_FILE_NAME = "control.secret"
#: A shorter secret is refused (a typo, not a secret).
MIN_SECRET_CHARS = 16
#: A longer file is not a secret (a wrong path): refused before reading it all.
MAX_SECRET_BYTES = 4096
#: Seconds a signed request stays acceptable either side of the agent's clock.
WINDOW_S = 10.0
#: Accepted MACs remembered for the replay check (the broker forwards at most one request a
#: run a second, so a window holds ~10; the bound is for a clock jump).
MAX_SEEN = 1024
#: Why an agent with a secret refused a control message (the keys of ``Verifier.refused``).
REFUSALS = ("unsigned", "bad_mac", "stale", "replayed")
#: Domain separation: this key signs nothing else.
DOMAIN = b"rankboard-control-1\0"

_MAC_BYTES = 32
#: How a signed body ends: the map key ``"mac"`` then a 32-byte bin header, then the MAC.
_MAC_TAG = b"\xa3mac\xc4\x20"


class SecretError(ValueError):
    """A secret that is configured but cannot be used; ``str()`` is one line naming it."""


class _Signed(ControlRequest, kw_only=True, omit_defaults=True, gc=False,
              forbid_unknown_fields=False):
    """A request as the broker sends it under a secret: ``t`` and ``mac`` last."""

    t: float = 0.0
    mac: bytes = b""


class _Stamp(msgspec.Struct, forbid_unknown_fields=False):
    t: float = float("nan")


_encoder = msgspec.msgpack.Encoder()
_stamp = msgspec.msgpack.Decoder(_Stamp)


def default_secret_file(env: Optional[Mapping[str, str]] = None) -> Path:
    """``<default data dir>/control.secret``: ``$XDG_STATE_HOME/rankboard``, else
    ``~/.local/state/rankboard`` (``broker.config.default_data_dir``'s rule, repeated here
    because the agent never imports the broker)."""
    env = os.environ if env is None else env
    state = env.get("XDG_STATE_HOME")
    base = Path(state) if state else Path.home() / ".local" / "state"
    return base / "rankboard" / SECRET_FILE_NAME


def _key(text: str, where: str) -> bytes:
    text = text.strip()
    if len(text) < MIN_SECRET_CHARS:
        raise SecretError(f"{where} holds {len(text)} characters; a control secret has at "
                          f"least {MIN_SECRET_CHARS}")
    return text.encode("utf-8", "surrogateescape")


def read_secret(path: Path) -> bytes:
    """The key a secret file holds; :class:`SecretError` (one line) when it cannot be used.
    ``OSError`` from opening it is turned into one too."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_SECRET_BYTES + 1)
    except OSError as exc:
        raise SecretError(f"cannot read control secret {path}: {exc.strerror or exc}") from None
    if len(data) > MAX_SECRET_BYTES:
        raise SecretError(f"control secret {path} is over {MAX_SECRET_BYTES} bytes: not a secret")
    return _key(data.decode("utf-8", "surrogateescape"), f"control secret {path}")


def agent_secret(env: Optional[Mapping[str, str]] = None, endpoint: Optional[str] = None
                 ) -> Tuple[Optional[bytes], str]:
    """(the key, where it came from) for an agent whose control channel connects to
    ``endpoint``; (None, why none) without one.

    :class:`SecretError` when one is configured (either variable) but unusable; the default
    file is used only for the default endpoint (None: any), and only when it exists and can
    be read (another user's broker: none)."""
    env = os.environ if env is None else env
    text = env.get(SECRET_ENV, "")
    if text.strip():
        return _key(text, f"${SECRET_ENV}"), f"${SECRET_ENV}"
    named = env.get(SECRET_FILE_ENV, "")
    if named.strip():
        path = Path(named.strip()).expanduser()
        return read_secret(path), str(path)
    path = default_secret_file(env)
    if endpoint is not None and not is_default_endpoint(endpoint):
        return None, f"no {SECRET_ENV} or {SECRET_FILE_ENV} (the default secret is the " \
                     f"default broker's, {DEFAULT_PUBLISH})"
    try:
        return read_secret(path), str(path)
    except SecretError as exc:
        if not path.exists():
            return None, f"no {SECRET_ENV}, {SECRET_FILE_ENV} or {path}"
        return None, str(exc)


def broker_secret(path: Path) -> Tuple[bytes, bool]:
    """(the key in ``path``, whether it was created now): read it, or create it when there is
    no such file: written whole to a temporary file (``0600``, under a ``0077`` umask) and
    linked to ``path``, so a reader (another shard's broker starting at the same moment)
    sees a whole secret or none, and two brokers never overwrite each other's. A file that
    exists but cannot be used is :class:`SecretError`: never replaced silently, since the
    agents may already read it."""
    created = False
    if not path.exists():
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        old = os.umask(0o077)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(fd, (secrets.token_hex(32) + "\n").encode())
                os.fsync(fd)
            finally:
                os.close(fd)
            try:
                os.link(tmp, path)
                created = True
            except FileExistsError:  # another broker made it first: theirs is the one
                pass
        except OSError as exc:
            raise SecretError(f"cannot create control secret {path}: "
                              f"{exc.strerror or exc}") from None
        finally:
            os.umask(old)
            try:
                os.unlink(tmp)
            except OSError:
                pass
    return read_secret(path), created


def is_default_endpoint(endpoint: str) -> bool:
    """Whether ``endpoint`` is ``rankboard up``'s default publish endpoint (the control
    channel of a rank whose broker runs with the defaults), ``localhost`` spelled either way."""
    return endpoint.strip().replace("//localhost:", "//127.0.0.1:") == DEFAULT_PUBLISH


def trust_summary(path: Path, publish: str, env: Optional[Mapping[str, str]] = None) -> str:
    """Who obeys whom, for the broker's and ``rankboard up``'s line at start: the ranks that
    read the secret at ``path`` (by default, when it is the default data dir's) and the
    others (``publish``: the endpoints a squatter would bind)."""
    own = (path.expanduser().absolute() == default_secret_file(env).absolute()
           and is_default_endpoint(publish))
    who = (f"ranks of this user on this host read {path} by default and" if own
           else f"ranks given {SECRET_FILE_ENV}={path}")
    return (f"{who} obey only this broker; any other rank obeys whatever process on this "
            f"host binds {publish} (CURVE aside)")


def _mac(key: bytes, topic: bytes, signed: bytes) -> bytes:
    return hmac.new(key, DOMAIN + topic + b"\0" + signed, hashlib.sha256).digest()


def sign_request(key: bytes, req: ControlRequest, now: float) -> list[bytes]:
    """The two parts to publish for ``req``, signed with ``key`` at unix time ``now``."""
    fields = {name: getattr(req, name) for name in req.__struct_fields__}
    body = _encoder.encode(_Signed(**fields, t=now, mac=bytes(_MAC_BYTES)))
    if not body.endswith(_MAC_TAG + bytes(_MAC_BYTES)):  # the field order is msgspec's promise
        raise AssertionError("a signed control request must end with its MAC")
    topic = control_topic(req.run)
    head = body[:-_MAC_BYTES]
    return [topic, head + _mac(key, topic, head)]


class Verifier:
    """An agent's check of each control message under a secret (module docstring).

    :meth:`check` returns None for a request to act on, else the reason it is refused, and
    counts it in :attr:`refused`. Pure: the caller passes its clock; not thread-safe (one
    control thread owns it)."""

    def __init__(self, key: bytes, window: float = WINDOW_S) -> None:
        self._key = key
        self.window = window
        #: reason -> messages refused since start
        self.refused: Dict[str, int] = dict.fromkeys(REFUSALS, 0)
        #: MAC -> its ``t``, for the requests accepted within the window
        self._seen: Dict[bytes, float] = {}

    def _refuse(self, reason: str) -> str:
        self.refused[reason] += 1
        return reason

    def check(self, parts: list[bytes], now: float) -> Optional[str]:
        if len(parts) != 2:
            return self._refuse("unsigned")
        topic, body = parts
        if len(body) < len(_MAC_TAG) + _MAC_BYTES or \
                body[-_MAC_BYTES - len(_MAC_TAG):-_MAC_BYTES] != _MAC_TAG:
            return self._refuse("unsigned")
        head, mac = body[:-_MAC_BYTES], body[-_MAC_BYTES:]
        if not hmac.compare_digest(mac, _mac(self._key, topic, head)):
            return self._refuse("bad_mac")
        try:
            t = _stamp.decode(body).t
        except (msgspec.DecodeError, msgspec.ValidationError):
            t = float("nan")
        if not abs(now - t) <= self.window:  # NaN (no stamp) is outside too
            return self._refuse("stale")
        if mac in self._seen:
            return self._refuse("replayed")
        if len(self._seen) >= MAX_SEEN:
            self._seen = {m: s for m, s in self._seen.items() if abs(now - s) <= self.window}
            if len(self._seen) >= MAX_SEEN:  # a clock that jumped: forget the oldest half
                kept = sorted(self._seen.items(), key=lambda item: item[1])[MAX_SEEN // 2:]
                self._seen = dict(kept)
        self._seen[mac] = t
        return None
