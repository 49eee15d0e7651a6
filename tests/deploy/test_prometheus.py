"""deploy/prometheus: the alert rules load (``promtool check rules``), behave as their unit
tests say (``promtool test rules``: each alert fires when it should, once per deployment
however many workers export the series, and not otherwise), and the example config loads
(``promtool check config``). The metric names are the ones web/metrics.py exports."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

from tests.support import REPO
from tests.support.deploy import DEPLOY, tool

PROM = DEPLOY / "prometheus"


def run(*args: str, cwd: Path = PROM) -> str:
    done = subprocess.run(list(args), cwd=cwd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_rules_check() -> None:
    out = run(tool("promtool", "prometheus"), "check", "rules", "rankboard.rules.yml")
    assert "SUCCESS: 5 rules found" in out


def test_rules_unit_tests() -> None:
    out = run(tool("promtool", "prometheus"), "test", "rules", "rankboard.rules.test.yml")
    assert "SUCCESS" in out


def test_example_config_check(tmp_path: Path) -> None:
    promtool = tool("promtool", "prometheus")
    token = tmp_path / "rankboard.token"
    token.write_text("t0ken\n")
    config = (PROM / "prometheus.yml").read_text()
    assert "/etc/prometheus/rankboard.token" in config
    (tmp_path / "prometheus.yml").write_text(
        config.replace("/etc/prometheus/rankboard.token", str(token)))
    shutil.copy(PROM / "rankboard.rules.yml", tmp_path)
    shutil.copy(PROM / "rankboard-gpu.rules.yml", tmp_path)
    shutil.copy(PROM / "rankboard-datadir.rules.yml", tmp_path)
    out = run(promtool, "check", "config", "prometheus.yml", cwd=tmp_path)
    assert "SUCCESS" in out


def test_rules_use_only_metrics_the_web_exports() -> None:
    exported = set(re.findall(r'"(rankboard_[a-z_]+)"', "".join(  # the families' two modules
        (REPO / "web" / name).read_text() for name in ("metrics.py", "metricsranks.py"))))
    rules = (PROM / "rankboard.rules.yml").read_text()
    exprs = " ".join(re.findall(r"expr: ([^\n]+(?:\n {10,}[^\n]+)*)", rules))
    used = set(re.findall(r"\b(rankboard_[a-z_]+)", exprs))
    # a counter family is exposed with a _total suffix
    unknown = {name for name in used if name not in exported
               and name.removesuffix("_total") not in exported}
    assert used and not unknown, unknown
