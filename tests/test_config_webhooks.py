"""The alert webhook flags from the command line to the broker's config (PROTOCOL 3.1, 6):
the URLs reach the server and ``up``'s broker child through its environment, never its
argv or a config's repr; --alert-repeat and --public-url travel as flags."""
from __future__ import annotations

from broker.config import BrokerConfig
from broker.webhooks.notifier import DEFAULT_REPEAT, ENV_VAR
from rankboard.cli import build_parser
from rankboard.config import UpConfig, from_args

SECRET = "https://hooks.slack.com/services/T000/B000/SECRET"


def parse(*argv: str) -> BrokerConfig:
    cfg = from_args(build_parser().parse_args(list(argv)))
    return cfg.broker if isinstance(cfg, UpConfig) else cfg  # type: ignore[return-value]


def test_up_config_keeps_the_urls_out_of_argv_and_repr() -> None:
    cfg = parse("up", "--alert-webhook", SECRET, "--alert-webhook", "http://127.0.0.1:9/x",
                "--alert-repeat", "60", "--public-url", "https://board.example.org")
    assert cfg.alert_webhooks == (SECRET, "http://127.0.0.1:9/x")
    argv = cfg.argv()
    assert not any("SECRET" in a or "127.0.0.1:9" in a for a in argv), argv
    assert argv[argv.index("--alert-repeat") + 1] == "60.0"
    assert argv[argv.index("--public-url") + 1] == "https://board.example.org"
    assert "SECRET" not in repr(cfg)
    assert cfg.child_env() == {ENV_VAR: f"{SECRET} http://127.0.0.1:9/x"}
    server = cfg.build_server()
    assert server.webhooks.urls == [SECRET, "http://127.0.0.1:9/x"]
    assert server.webhooks._grouper.repeat == 60.0
    assert server.webhooks._grouper.public_url == "https://board.example.org"


def test_the_child_parses_back_what_it_is_given() -> None:
    cfg = parse("up", "--alert-repeat", "120")
    child = parse(*cfg.argv())
    assert child.alert_repeat == 120.0 and child.public_url is None
    assert cfg.child_env() == {ENV_VAR: ""}  # the child takes exactly these: none
    assert parse("broker").alert_repeat == DEFAULT_REPEAT
    assert "--alert-repeat" not in parse("broker").argv()
