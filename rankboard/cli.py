"""``rankboard`` entry point: argparse for every subcommand, dispatch, logging setup.

All flags of all subcommands are defined here, in one place, so ``broker``, ``web``, ``up``
and ``demo`` cannot drift apart. The parsed flags become typed configs once
(:func:`rankboard.config.from_args`); nothing below reads an ``argparse.Namespace``. The
commands that serve a web (``web``, ``up``, ``demo``: ``rankboard/up.py``) and ``keys`` are
imported lazily: ``rankboard broker`` never imports gevent or Flask.

Errors a user can cause (bad flags, an address in use, an unreadable data dir) end in one
line on stderr naming the problem and a non-zero exit (2 for usage, 1 otherwise), never a
traceback. SIGINT and SIGTERM stop cleanly with exit 0.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any, Callable, NoReturn, Sequence

from broker.config import BrokerConfig, default_data_dir
from broker.webhooks.notifier import DEFAULT_REPEAT, ENV_VAR, redact, webhook_urls
from rank_agent.controlauth import SECRET_FILE_ENV
from rank_agent.protocol import DEFAULT_INGEST, DEFAULT_PUBLISH, DEFAULT_SNAPSHOT
from rank_agent.shards import ShardError, parse_shard
from rankboard.argfix import subcommand_parser, unknown_flags_message
from rankboard.config import KeysConfig, from_args, log_level
from rankboard.preflight import data_dir_problem
from rankboard.shardplan import MAX_SHARDS
from web.config import DEFAULT_WEB_HOST, DEFAULT_WEB_PORT, FeedError, feed_pairs

__all__ = ["main", "build_parser", "run_broker"]

log = logging.getLogger(__name__)


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line: ``<prog>: <problem> (see --help)``.

    Prefix matching is off (``allow_abbrev``): argparse would take ``demo --rank 4`` as
    ``--ranks 4`` and ``up --shard 2`` as ``--shards 2`` without a word, so a typo silently
    meant another flag; now it is an unknown flag with a "did you mean". The subcommand
    parsers are built by ``add_subparsers`` with this class too, so they inherit both."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {_with_suggestion(self, message)} (see {self.prog} --help)\n")


def _with_suggestion(parser: argparse.ArgumentParser, message: str) -> str:
    """``invalid choice: 'upp' (choose from ...)`` gains ``did you mean 'up'?`` when a
    command is close (``rankboard upp``): the list of every command is what argparse gives."""
    import difflib
    import re

    found = re.search(r"invalid choice: '([^']*)'", message)
    if found is None:
        return message
    choices = [c for a in parser._actions if isinstance(a, argparse._SubParsersAction)
               for c in a.choices]
    close = difflib.get_close_matches(found.group(1), choices, n=1, cutoff=0.6)
    return f"{message}; did you mean '{close[0]}'?" if close else message


def _command(sub: Any, name: str, what: str) -> argparse.ArgumentParser:
    """A subcommand whose ``--help`` opens with what it does (its one-line ``help`` in the
    command list is the same sentence)."""
    parser: argparse.ArgumentParser = sub.add_parser(
        name, help=what, description=f"rankboard {name}: {what}.")
    return parser


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return value


def _size(text: str) -> int:
    from broker.retention.plan import parse_size

    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _int_range(lo: int, hi: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < lo or (hi is not None and value > hi):
            bound = f"{lo}..{hi}" if hi is not None else f">= {lo}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
        return value

    parse.__name__ = "integer"
    return parse


def _public_url(text: str) -> str:
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(text)
        ok = parts.scheme in ("http", "https") and bool(parts.hostname)
        parts.port  # noqa: B018 - raises ValueError for a bad port
    except ValueError:
        ok = False
    if not ok:
        raise argparse.ArgumentTypeError(
            f"not an http(s) URL with a host: {redact(text)} (expected e.g. https://board.example.org)")
    return text


def _endpoint(text: str) -> str:
    if "://" not in text:
        raise argparse.ArgumentTypeError(
            f"not a ZeroMQ endpoint: {text!r} (expected e.g. tcp://127.0.0.1:5585)"
        )
    return text


def _shard(text: str) -> tuple[int, int]:
    try:
        return parse_shard(text)
    except ShardError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("-v", "--verbose", action="count", default=0,
                   help="more logging (-v: DEBUG)")
    p.add_argument("--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"], type=str.upper,
                   help="logging level (default INFO)")


def _feed_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--publish", type=_endpoint, default=DEFAULT_PUBLISH,
                   help=f"broker PUB endpoint (default {DEFAULT_PUBLISH})")
    p.add_argument("--snapshot", type=_endpoint, default=DEFAULT_SNAPSHOT,
                   help=f"broker snapshot ROUTER endpoint (default {DEFAULT_SNAPSHOT})")


def _broker_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ingest", type=_endpoint, default=DEFAULT_INGEST,
                   help=f"PULL endpoint the ranks push to (default {DEFAULT_INGEST}; "
                        "a cluster passes tcp://*:5585)")
    p.add_argument("--data-dir", type=Path, default=None,
                   help=f"where runs are journaled (default {default_data_dir()})")
    p.add_argument("--stale-after", type=_positive_float, default=30.0,
                   help="seconds of silence before a rank is stale (default 30)")
    p.add_argument("--step-close-after", type=_positive_float, default=10.0,
                   help="seconds after its first point a step closes even if ranks are "
                        "missing (default 10)")
    p.add_argument("--max-runs", type=_int_range(1), default=1000,
                   help="runs held in memory; the oldest finished is evicted (default 1000)")
    p.add_argument("--retention-days", type=_positive_float, default=None,
                   help="delete ended runs whose last frame is older than this many days, "
                        "at start and every 30 s (fractions allowed; default: keep forever)")
    p.add_argument("--retain-bytes", type=_size, default=None, metavar="SIZE",
                   help="bound the runs' files in the data dir: ended runs are deleted, least "
                        "recently updated first, until they fit (e.g. 500G; K, M, G, T are "
                        "powers of 1,024; default: no bound; up --shards N: SIZE / N each)")
    p.add_argument("--curve-secret-key", type=Path, default=None,
                   help="broker CURVE secret key file (from `rankboard keys`); "
                        "needs --curve-authorized")
    p.add_argument("--curve-authorized", type=Path, default=None,
                   help="directory of authorized client public keys")
    p.add_argument("--curve-web-authorized", type=Path, default=None, metavar="PATH",
                   help="the webs' public keys (a directory, e.g. authorized-webs/ of "
                        "`rankboard keys`, or one key file): under CURVE only these may make "
                        "ranks dump their stacks (up/demo: their web's --curve-client-key)")
    # (v3, PROTOCOL 3.1) no type=: argparse would echo a bad URL, secret and all
    p.add_argument("--alert-webhook", action="append", default=[], metavar="URL",
                   help="POST every alert to this URL (repeatable; Slack- and Discord-style "
                        f"incoming webhooks read the body's text/content; also ${ENV_VAR}, "
                        "URLs separated by whitespace)")
    p.add_argument("--alert-repeat", type=_positive_float, default=DEFAULT_REPEAT,
                   metavar="SECONDS", help="post an alert of the same run, kind and rank again "
                   f"only after this long (default {DEFAULT_REPEAT:g})")
    p.add_argument("--public-url", type=_public_url, default=None, metavar="URL",
                   help="the dashboard's address as people reach it, for the run links in "
                        "alert webhooks (e.g. https://board.example.org)")
    secret_file = os.environ.get(SECRET_FILE_ENV, "").strip()
    p.add_argument("--control-secret-file", type=Path, metavar="FILE",
                   default=Path(secret_file) if secret_file else None,
                   help="the secret that signs requests for dumps to the ranks (created 0600 "
                        "if missing; ranks that read it obey only this broker; also "
                        f"${SECRET_FILE_ENV}; default <data-dir>/control.secret)")


def _web_flags(p: argparse.ArgumentParser, *, port_default: int | None) -> None:
    p.add_argument("--host", default=DEFAULT_WEB_HOST,
                   help=f"web bind address (default {DEFAULT_WEB_HOST})")
    port_help = ("web port (default: bind lazily on the first port a rank registers)"
                 if port_default is None else f"web port (default {port_default})")
    p.add_argument("--port", type=_int_range(0, 65535), default=port_default, help=port_help)
    p.add_argument("--token", default=os.environ.get("RANKBOARD_TOKEN"),
                   help="bearer token required by the web (default $RANKBOARD_TOKEN); "
                        "prefer --token-file or the variable: a command line shows in ps")
    p.add_argument("--token-file", type=Path, default=None, metavar="FILE",
                   help="read the bearer token from FILE (its first line, surrounding "
                        "blanks stripped); overrides --token and $RANKBOARD_TOKEN")
    p.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                   help="a Host name a web without a token also answers (repeatable; "
                        "default: localhost, 127.0.0.1, [::1] and the bound address), for "
                        "a proxy in front of it")
    p.add_argument("--insecure-no-auth", action="store_true",
                   help="allow a non-loopback --host without a token")
    p.add_argument("--read-only", action="store_true",
                   help="refuse requests for stack dumps and profiles (POST .../stacks: "
                        "403) and show no request buttons; the dashboard only reads")
    p.add_argument("--curve-server-key", type=Path, default=None, metavar="FILE",
                   help="the broker's public key file (server.key from `rankboard keys`): "
                        "connect to its publish and snapshot sockets with CURVE; needs "
                        "--curve-client-key (up/demo: defaults to --curve-secret-key's)")
    p.add_argument("--curve-client-key", type=Path, default=None, metavar="FILE",
                   help="this web's key pair (webs/web-N.key_secret from `rankboard keys`), "
                        "whose public key the broker's --curve-authorized directory holds")


def _scale_flags(p: argparse.ArgumentParser, *, worker_id: bool) -> None:
    p.add_argument("--workers", type=_int_range(1, 256), default=1, metavar="N",
                   help="web processes sharing the port (SO_REUSEPORT, Linux), each with its "
                        "own feed subscription; a worker that dies is restarted (default 1)")
    p.add_argument("--metrics-port", type=_int_range(0, 65535), default=None, metavar="PORT",
                   help="also serve /metrics and /healthz of worker K alone on port "
                        "PORT+K-1, so Prometheus scrapes each worker (0: ephemeral ports, "
                        "logged; default: off)")
    p.add_argument("--metrics-host", default=None, metavar="HOST",
                   help="address of the --metrics-port listeners (default: --host)")
    if worker_id:  # set by the supervisor of --workers N on the processes it starts
        p.add_argument("--worker-id", type=_int_range(1, 256), default=None,
                       help=argparse.SUPPRESS)


def build_parser() -> argparse.ArgumentParser:
    """The whole ``rankboard`` command line (every subcommand's flags)."""
    parser = _Parser(prog="rankboard", description="Live dashboards for distributed training.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = _command(sub, "broker", "run the broker (ingest, feed, journal)")
    _broker_flags(p)
    p.add_argument("--shard", type=_shard, default=(0, 1), metavar="K/N",
                   help="own the runs whose id hashes to shard K of N brokers (default 0/1; "
                        "PROTOCOL 7.3)")
    _feed_flags(p)
    _common(p)

    p = _command(sub, "web", "run the web dashboard against a broker")
    _feed_flags(p)
    _web_flags(p, port_default=DEFAULT_WEB_PORT)
    _scale_flags(p, worker_id=True)
    _common(p)

    p = _command(sub, "up", "broker and web in one command")
    _broker_flags(p)
    _feed_flags(p)
    _web_flags(p, port_default=None)
    _scale_flags(p, worker_id=False)
    p.add_argument("--shards", type=_int_range(1, MAX_SHARDS), default=1, metavar="N",
                   help="start N brokers, each owning the runs whose id hashes to it "
                        "(shard K: ports + 3*K, <data-dir>/shard-K; default 1)")
    p.add_argument("--port-from-rank", action="store_true",
                   help="bind the web on the first port a rank registers instead of at once "
                        "(the launcher rule; excludes --port)")
    p.set_defaults(worker_id=None)
    for action in p._actions:  # up's own default (PROTOCOL 8.5): None tells --port apart
        if action.dest == "port":
            action.help = (f"web port (default {DEFAULT_WEB_PORT}, bound at once; "
                           "--port-from-rank: the first port a rank registers)")
    _common(p)

    p = _command(sub, "demo", "everything plus a simulated cluster of real agents")
    _broker_flags(p)
    _feed_flags(p)
    _web_flags(p, port_default=DEFAULT_WEB_PORT)
    p.add_argument("--ranks", type=_int_range(1, 65536), default=8, help="ranks (default 8)")
    p.add_argument("--hosts", type=_int_range(1, 65536), default=2, help="hosts (default 2)")
    p.add_argument("--epochs", type=_int_range(1), default=20, help="epochs (default 20)")
    p.add_argument("--epoch-seconds", type=_positive_float, default=2.0,
                   help="seconds per simulated epoch (default 2.0)")
    p.add_argument("--shards", type=_int_range(1, MAX_SHARDS), default=1, metavar="N",
                   help="run the demo on N brokers (PROTOCOL 7.3; default 1)")
    p.add_argument("--rounds", type=_int_range(0), default=0, metavar="N",
                   help="rounds of runs, then no new run (default 0: a new round about every "
                        "minute until Ctrl-C)")
    p.add_argument("--no-browser", action="store_true",
                   help="do not open the dashboard in a browser (it opens only where there "
                        "is a display)")
    p.set_defaults(workers=1, metrics_port=None, metrics_host=None, worker_id=None)
    _common(p)
    for action in p._actions:  # the demo's own defaults: a private broker, a temporary dir
        if action.dest == "data_dir":
            action.help = ("where runs are journaled (default: a temporary dir, removed at "
                           "exit; give one to keep the runs for `rankboard export`)")
        elif action.dest in ("ingest", "publish", "snapshot"):
            action.help = f"the private broker's {action.dest} endpoint (default: a free port)"

    p = _command(sub, "keys", "create CURVE key pairs in DIR")
    p.add_argument("dir", type=Path, metavar="DIR", help="directory for the key pairs")
    p.add_argument("--clients", type=_int_range(1, 10_000), default=1,
                   help="client key pairs to have (client-1 .. client-N; existing ones are "
                        "kept, default 1)")
    p.add_argument("--webs", type=_int_range(0, 10_000), default=1,
                   help="web key pairs to have (webs/web-1 .. web-N), for webs that read the "
                        "broker's CURVE-protected feed (default 1)")
    _common(p)

    p = _command(sub, "export", "write a run's report.html (one self-contained file) "
                 "from the journal")
    p.add_argument("run", metavar="RUN", help="the run id")
    p.add_argument("-o", "--output", type=Path, default=None, metavar="FILE",
                   help="where to write it (default: <run>.html, ':' as '_', here)")
    p.add_argument("--data-dir", type=Path, default=None, metavar="DIR",
                   help="the broker's data dir (default: a rankboard folder in the user's "
                        "state directory); read only, a broker may be running on it")
    _common(p)
    return parser


def _configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level, stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def _install_stop_handlers(stop: Callable[[], None]) -> None:
    """SIGINT/SIGTERM call ``stop`` (main thread only; elsewhere the caller stops us).
    ``stop`` must only note the signal (set an attribute): no lock, no I/O, since a second
    signal can land while the main thread is inside the first one's handler or anywhere
    else (``BrokerServer.stop``)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop())


def run_broker(cfg: BrokerConfig) -> int:
    """``rankboard broker``: bind, serve until SIGINT/SIGTERM, close."""
    from broker.server import tune_gc

    tune_gc()  # process-wide: here in the entry point, not at import
    server = cfg.build_server()
    # before bind: a signal during the bind (or the journal's replay) is noted, and the
    # loop then returns at once; installed after, it would kill the process mid-start
    _install_stop_handlers(server.stop)
    try:
        server.bind()
        print(f"shard {cfg.shard[0]}/{cfg.shard[1]}", flush=True)
        server.serve_forever()
    finally:
        server.close()
    log.info("broker stopped")
    return 0


def _web(cfg: Any) -> int:
    from rankboard import up  # lazy: gevent is patched only by the web's commands

    return up.web_main(cfg)


def _up(cfg: Any) -> int:
    from rankboard import up

    return up.up_main(cfg)


def _demo(cfg: Any) -> int:
    from rankboard import up

    return up.demo_main(cfg)


def _keys(cfg: KeysConfig) -> int:
    from rankboard.keys import keys_main

    return keys_main(cfg.dir, cfg.clients, cfg.webs)


def _export(args: Any) -> int:
    from rankboard.export import export_main  # lazy: no Flask for the other commands

    return export_main(args.run, args.output, args.data_dir or default_data_dir())


_COMMANDS: dict[str, Callable[[Any], int]] = {
    "broker": run_broker,
    "web": _web,
    "up": _up,
    "demo": _demo,
    "keys": _keys,
    "export": _export,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Console script ``rankboard``; returns the exit status."""
    parser = build_parser()
    try:
        args, extras = parser.parse_known_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2, already printed)
        return int(exc.code or 0)
    sub = subcommand_parser(parser, args.command)
    if extras:  # a mistyped flag: the subcommand's closest one and its own --help
        print(unknown_flags_message(sub or parser, extras), file=sys.stderr)
        return 2
    prog = f"rankboard {args.command}"
    if hasattr(args, "curve_secret_key") and (
        (args.curve_secret_key is None) != (args.curve_authorized is None)
    ):
        print(f"{prog}: --curve-secret-key and --curve-authorized go together", file=sys.stderr)
        return 2
    if getattr(args, "port_from_rank", False) and args.port is not None:
        print(f"{prog}: --port and --port-from-rank exclude each other: give one",
              file=sys.stderr)
        return 2
    problem = (_feed_problem(args) or data_dir_problem(getattr(args, "data_dir", None))
               or _curve_client_problem(args) or _read_token_file(args))
    if problem:
        print(f"{prog}: {problem}", file=sys.stderr)
        return 2
    if hasattr(args, "alert_webhook"):
        try:  # flags and $RANKBOARD_ALERT_WEBHOOK; a bad one is named by scheme and host only
            args.alert_webhook = webhook_urls(args.alert_webhook)
        except ValueError as exc:
            print(f"{prog}: {exc}", file=sys.stderr)
            return 2
    _configure_logging(log_level(args))
    cfg = args if args.command == "export" else from_args(args)  # export: no server config
    try:
        return int(_COMMANDS[args.command](cfg) or 0)
    except KeyboardInterrupt:
        return 0
    except ImportError as exc:
        print(f"{prog}: not available: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # BindError, data dir problems, ...
        print(f"{prog}: {_one_line(exc)}", file=sys.stderr)
        return 1


def _feed_problem(args: argparse.Namespace) -> str | None:
    """Why the endpoint lists cannot work (PROTOCOL 7.3), or None: a web's ``--publish``
    and ``--snapshot`` list one endpoint per shard each, the same number; a broker (and
    ``up``/``demo``, which start theirs) binds one of each."""
    if not hasattr(args, "publish"):
        return None
    if args.command == "web":
        try:
            feed_pairs(args.publish, args.snapshot)
        except FeedError as exc:
            return str(exc)
        return None
    for flag in ("ingest", "publish", "snapshot"):
        if "," in getattr(args, flag, ""):
            return f"--{flag} takes one endpoint here (a list is for `rankboard web`)"
    return None


def _curve_client_problem(args: argparse.Namespace) -> str | None:
    """Why the web's CURVE flags cannot work together, or None.

    ``web``: both key files or neither. ``up``/``demo``: their broker demands CURVE on the
    feed as soon as it has a secret key, so their web needs a key pair the broker
    authorizes; and a web key without a CURVE broker could never connect.
    """
    if not hasattr(args, "curve_client_key"):
        return None
    client, server = args.curve_client_key, args.curve_server_key
    if not hasattr(args, "curve_secret_key"):  # web
        if (client is None) != (server is None):
            return "--curve-server-key and --curve-client-key go together"
        return None
    if args.curve_secret_key is not None and client is None:
        return ("with --curve-secret-key the broker's feed demands CURVE: pass "
                "--curve-client-key (a web key pair in --curve-authorized, e.g. "
                "webs/web-1.key_secret from `rankboard keys`)")
    if args.curve_secret_key is None and (client is not None or server is not None):
        return "--curve-client-key/--curve-server-key need --curve-secret-key (a CURVE broker)"
    return None


#: The most bytes of a ``--token-file`` read (a token is a line, not a document).
MAX_TOKEN_FILE_BYTES = 4096


def _read_token_file(args: argparse.Namespace) -> str | None:
    """Put ``--token-file``'s token in ``args.token``; the one-line problem, or None.

    The file is how a token stays out of ``ps`` (a flag value is on the command line for
    every user of the host to read); the web's own children get it by environment."""
    path = getattr(args, "token_file", None)
    if path is None:
        return None
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_TOKEN_FILE_BYTES + 1)
    except OSError as exc:
        return f"cannot read --token-file {path}: {exc.strerror or exc}"
    if len(raw) > MAX_TOKEN_FILE_BYTES:
        return f"--token-file {path} is over {MAX_TOKEN_FILE_BYTES} bytes: not a token"
    try:
        lines = raw.decode("utf-8").strip().splitlines()
    except UnicodeDecodeError:
        return f"--token-file {path} is not UTF-8 text"
    token = lines[0].strip() if lines else ""
    if not token:
        return f"--token-file {path} holds no token"
    args.token = token
    return None


def _one_line(exc: OSError) -> str:
    """``str(StartError)`` is already the message; other OSErrors read ``strerror: filename``."""
    from broker.server import StartError

    if isinstance(exc, StartError):
        return str(exc)
    if exc.strerror and exc.filename:
        return f"{exc.strerror}: {exc.filename}"
    return " ".join(str(exc).split())
