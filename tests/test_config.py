"""The typed configs: built once from the flags, and each one's ``argv()`` parses back into
itself, which is what the children of ``up``, ``demo`` and ``--workers`` rely on."""
from __future__ import annotations

from pathlib import Path

import pytest

from rankboard.cli import build_parser
from rankboard.config import BrokerConfig, DemoConfig, UpConfig, WebConfig, from_args


@pytest.fixture(autouse=True)
def _no_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANKBOARD_TOKEN", raising=False)


def _parse(argv: list[str]) -> object:
    return from_args(build_parser().parse_args(argv))


@pytest.mark.parametrize("cfg", [
    BrokerConfig(),
    BrokerConfig(ingest="tcp://*:6000", publish="tcp://127.0.0.1:*", snapshot="ipc:///tmp/s",
                 data_dir=Path("/var/lib/rb"), stale_after=2.5, step_close_after=0.25,
                 max_runs=7, retention_days=1.5, curve_secret_key=Path("/k/server.key_secret"),
                 curve_authorized=Path("/k/authorized"), log_level="WARNING"),
])
def test_broker_config_round_trips_through_its_argv(cfg: BrokerConfig) -> None:
    assert _parse(cfg.argv()) == cfg


@pytest.mark.parametrize("cfg", [
    WebConfig(),
    WebConfig(publish="tcp://b:1", snapshot="tcp://b:2", host="0.0.0.0", port=0,
              insecure_no_auth=True, curve_server_key=Path("/k/server.key"),
              curve_client_key=Path("/k/webs/web-1.key_secret"), workers=4, metrics_port=9100,
              metrics_host="127.0.0.1", log_level="DEBUG"),
    WebConfig(port=8600, worker_id=3, metrics_port=0),
])
def test_web_config_round_trips_through_its_argv(cfg: WebConfig) -> None:
    assert _parse(cfg.argv()) == cfg


def test_the_token_travels_in_the_environment_only() -> None:
    cfg = WebConfig(token="s3cret")
    assert "s3cret" not in " ".join(cfg.argv())
    assert cfg.env({"RANKBOARD_TOKEN": "other", "X": "1"})["RANKBOARD_TOKEN"] == "s3cret"
    assert "RANKBOARD_TOKEN" not in WebConfig().env({"RANKBOARD_TOKEN": "other"})


def test_a_worker_config() -> None:
    pool = WebConfig(host="0.0.0.0", port=None, workers=3, metrics_port=9100)
    two = pool.worker(2, 8600)
    assert (two.port, two.workers, two.worker_id, two.metrics_port, two.metrics_host) == (
        8600, 1, 2, 9101, "0.0.0.0")
    assert WebConfig(workers=2, metrics_port=0).worker(2, 1).metrics_port == 0  # ephemeral
    assert WebConfig(workers=2).worker(1, 1).metrics_host is None


def test_up_and_demo_share_the_flags_and_their_web_reads_the_brokers_key() -> None:
    up = _parse(["up", "--curve-secret-key", "/k/s", "--curve-authorized", "/k/a",
                 "--curve-client-key", "/k/w", "-v"])
    assert isinstance(up, UpConfig)
    assert up.broker.curve_secret_key == Path("/k/s") and up.broker.log_level == "DEBUG"
    assert (up.web.port, up.web.curve_server_key, up.web.curve_server_flag) == (
        8585, Path("/k/s"), "--curve-secret-key")  # 8585 at once (PROTOCOL 8.5)
    demo = _parse(["demo", "--ranks", "3", "--no-browser"])
    assert isinstance(demo, DemoConfig)
    assert (demo.ranks, demo.no_browser, demo.up.web.port, demo.up.web.workers) == (
        3, True, 8585, 1)


def test_the_command_line_imports_no_web_stack_and_patches_nothing_at_import() -> None:
    """``rankboard broker`` never loads gevent or Flask; gevent patches only when a web
    command starts (``web.serve.patch``), never because a module was imported."""
    import subprocess
    import sys

    code = ("import sys; import rankboard.cli as c; c.build_parser(); "
            "bad = [m for m in ('gevent', 'flask', 'web.serve', 'web.app') if m in sys.modules]; "
            "import rankboard.up, rankboard.demo, web.workers; "
            "from gevent import monkey; "
            "bad += ['patched'] if monkey.is_module_patched('socket') else []; "
            "sys.exit(repr(bad) if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60, cwd=Path(__file__).resolve().parent.parent)
    assert result.returncode == 0, result.stderr
