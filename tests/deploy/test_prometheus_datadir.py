"""deploy/prometheus/rankboard-datadir.rules.yml (PROTOCOL 8.4): the failing-journal and
near-the-bound alerts load (``promtool check rules``), behave as their unit tests say
(``promtool test rules``), use only families the web exports, and the example config loads
them."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

from tests.support import REPO
from tests.support.deploy import DEPLOY, tool

PROM = DEPLOY / "prometheus"
RULES = "rankboard-datadir.rules.yml"
DATADIR_METRICS = {"rankboard_data_dir_bytes", "rankboard_data_dir_retain_bytes",
                   "rankboard_journal_write_errors", "rankboard_runs_deleted"}


def run(*args: str, cwd: Path = PROM) -> str:
    done = subprocess.run(list(args), cwd=cwd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_datadir_rules_check() -> None:
    out = run(tool("promtool", "prometheus"), "check", "rules", RULES)
    assert "SUCCESS: 2 rules found" in out


def test_datadir_rules_unit_tests() -> None:
    out = run(tool("promtool", "prometheus"), "test", "rules", "rankboard-datadir.rules.test.yml")
    assert "SUCCESS" in out


def test_datadir_rules_use_only_metrics_the_web_exports() -> None:
    rules = (PROM / RULES).read_text()
    exprs = " ".join(re.findall(r"expr: (\|\n(?: {10,}[^\n]+\n)+|[^\n]+)", rules))
    used = {n.removesuffix("_total") for n in re.findall(r"\b(rankboard_[a-z_]+)", exprs)}
    assert used == DATADIR_METRICS, used
    exported = set(re.findall(r'"(rankboard_[a-z_]+)"', (REPO / "web" / "metrics.py").read_text()))
    assert DATADIR_METRICS <= exported, DATADIR_METRICS - exported


def test_the_example_config_loads_the_datadir_rules(tmp_path: Path) -> None:
    config = (PROM / "prometheus.yml").read_text()
    assert re.search(rf"^  - {re.escape(RULES)}\b", config, re.MULTILINE), config
    token = tmp_path / "rankboard.token"
    token.write_text("t0ken\n")
    (tmp_path / "prometheus.yml").write_text(
        config.replace("/etc/prometheus/rankboard.token", str(token)))
    for name in ("rankboard.rules.yml", "rankboard-gpu.rules.yml", RULES):
        shutil.copy(PROM / name, tmp_path)
    assert "SUCCESS" in run(tool("promtool", "prometheus"), "check", "config", "prometheus.yml",
                            cwd=tmp_path)
