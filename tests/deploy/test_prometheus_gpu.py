"""deploy/prometheus/rankboard-gpu.rules.yml: the GPU health and webhook alerts load
(``promtool check rules``) and behave as their unit tests say (``promtool test rules``), and
they use exactly the metric names rankboard exports for the GPU health fields."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

from tests.support import REPO
from tests.support.deploy import DEPLOY, tool

PROM = DEPLOY / "prometheus"
RULES = "rankboard-gpu.rules.yml"

#: The GPU health families /metrics exports, labelled {run, rank, host, gpu} (throttle also
#: {reason}), and the webhook counters of PROTOCOL.md section 3.1.
GPU_METRICS = {
    "rankboard_gpu_sm_clock_mhz", "rankboard_gpu_throttle", "rankboard_gpu_xid_errors",
    "rankboard_gpu_last_xid", "rankboard_gpu_ecc_uncorrected", "rankboard_gpu_remapped_rows_pending",
    "rankboard_gpu_remapped_rows_failed", "rankboard_gpu_pcie_link_gen", "rankboard_gpu_pcie_link_gen_max",
    "rankboard_gpu_pcie_link_width", "rankboard_gpu_pcie_link_width_max", "rankboard_gpu_nvlink_errors",
    "rankboard_webhooks_sent", "rankboard_webhooks_failed", "rankboard_webhooks_dropped",
}


def run(*args: str, cwd: Path = PROM) -> str:
    done = subprocess.run(list(args), cwd=cwd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def _used() -> set[str]:
    rules = (PROM / RULES).read_text()
    exprs = " ".join(re.findall(r"expr: ([^\n]+(?:\n {10,}[^\n]+)*)", rules))
    return {name.removesuffix("_total") for name in re.findall(r"\b(rankboard_[a-z_]+)", exprs)}


def test_gpu_rules_check() -> None:
    out = run(tool("promtool", "prometheus"), "check", "rules", RULES)
    assert "SUCCESS: 8 rules found" in out


def test_gpu_rules_unit_tests() -> None:
    out = run(tool("promtool", "prometheus"), "test", "rules", "rankboard-gpu.rules.test.yml")
    assert "SUCCESS" in out


def test_gpu_rules_use_only_the_gpu_health_metric_names() -> None:
    used = _used()
    assert used and used <= GPU_METRICS, used - GPU_METRICS


def test_gpu_rules_use_only_metrics_the_web_exports() -> None:
    exported = set(re.findall(r'"(rankboard_[a-z_]+)"', "".join(  # the families' two modules
        (REPO / "web" / name).read_text() for name in ("metrics.py", "metricsranks.py"))))
    unknown = {name for name in _used() if name not in exported}
    assert not unknown, unknown
    # and every family the rules test expects is one the web exports
    assert GPU_METRICS <= exported, GPU_METRICS - exported


def test_the_example_config_loads_the_gpu_rules() -> None:
    config = (PROM / "prometheus.yml").read_text()
    assert re.search(rf"^  - {re.escape(RULES)}\b", config, re.MULTILINE), config
