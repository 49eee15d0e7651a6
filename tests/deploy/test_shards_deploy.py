"""Shards' deploy files (PROTOCOL 7.3), tested against the CLI: the systemd template unit
(instance = shard) verifies, is hardened, and for every K of the environment file's N runs a
command line rankboard's own parser reads as ``--shard K/N`` with ports of its own; the
Kubernetes manifests' StatefulSet, headless Service and web Deployment agree on N, and their
command lines (``$(VAR)`` expanded as the kubelet does, the pod index as each ordinal) parse."""
from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from broker.config import BrokerConfig
from rankboard.cli import build_parser
from rankboard.shardplan import shard_configs
from tests.deploy.test_systemd import INSTALLED, unit_settings
from tests.support.deploy import DEPLOY, tool

SYSTEMD = DEPLOY / "systemd"
K8S = DEPLOY / "kubernetes"


def env_file(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            out[key] = value
    return out


def systemd_argv(k: int) -> list[str]:
    """ExecStart of ``rankboard-broker@<k>``: specifiers at load, then ``${VAR}`` at exec
    (systemd's order) from the one environment file."""
    [exec_start] = unit_settings("rankboard-broker@.service")["ExecStart"]
    line = exec_start.replace("%i", str(k)).replace("%d", "/run/credentials/unit")
    env = env_file(SYSTEMD / "rankboard-shards.env")
    line = re.sub(r"\$\{(\w+)\}", lambda m: env[m.group(1)], line)
    return shlex.split(line)


@pytest.fixture
def template_copies(tmp_path: Path) -> list[Path]:
    text = (SYSTEMD / "rankboard-broker@.service").read_text()
    assert INSTALLED in text
    unit = tmp_path / "rankboard-broker@1.service"  # an instance: what systemd loads
    unit.write_text(text.replace(INSTALLED, "/bin/true"))
    target = tmp_path / "rankboard-brokers.target"
    target.write_text((SYSTEMD / "rankboard-brokers.target").read_text())
    return [unit, target]


def test_template_and_target_verify(template_copies: list[Path]) -> None:
    analyze = tool("systemd-analyze", "systemd")
    done = subprocess.run([analyze, "verify", "--man=no", *map(str, template_copies)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and not done.stderr.strip(), done.stderr


def test_template_is_hardened(template_copies: list[Path]) -> None:
    analyze = tool("systemd-analyze", "systemd")
    done = subprocess.run([analyze, "security", "--offline=yes", "--no-pager",
                           str(template_copies[0])], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    exposure = float(done.stdout.split("Overall exposure level for")[1].split(":")[1].split()[0])
    assert exposure <= 2.0, done.stdout[-3000:]


def test_every_instance_is_its_shard_with_its_own_ports_and_journal() -> None:
    settings = unit_settings("rankboard-broker@.service")
    assert settings["EnvironmentFile"] == ["/etc/rankboard/shards.env"]
    assert settings["StateDirectory"] == ["rankboard/shard-%i"]
    assert settings["WantedBy"] == ["rankboard-brokers.target"]
    n = int(env_file(SYSTEMD / "rankboard-shards.env")["RANKBOARD_SHARDS"])
    assert n >= 2
    seen: list[Any] = []
    for k in range(n):
        argv = systemd_argv(k)
        assert argv[0] == INSTALLED
        args = build_parser().parse_args(argv[1:])  # SystemExit on any bad flag
        assert args.command == "broker" and args.shard == (k, n)
        assert str(args.data_dir) == f"/var/lib/rankboard/shard-{k}"
        assert args.curve_secret_key is not None and args.curve_authorized is not None
        seen.append((args.ingest, args.publish, args.snapshot))
    # the same ports `rankboard up --shards N` gives shard K (5585 + 3K, ...)
    plan = shard_configs(BrokerConfig(ingest="tcp://*:5585", publish="tcp://*:5586",
                                      snapshot="tcp://*:5587", data_dir=Path("/d")), n)
    assert seen == [(c.ingest, c.publish, c.snapshot) for c in plan]


def manifests() -> dict[str, dict[str, Any]]:
    docs: dict[str, dict[str, Any]] = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            docs[f"{doc['kind']}/{doc['metadata']['name']}"] = doc
    return docs


def kubelet_args(container: dict[str, Any], values: dict[str, str]) -> list[str]:
    """The container's command + args with ``$(VAR)`` expanded from its env (``values``
    for the ones the downward API fills), as the kubelet does."""
    env = {e["name"]: e.get("value", values.get(e["name"])) for e in container.get("env", [])}
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], str(a))
            for a in container["command"] + container["args"]]


def test_statefulset_pod_k_is_shard_k_with_its_own_volume() -> None:
    docs = manifests()
    sts = docs["StatefulSet/rankboard-broker"]
    svc = docs[f"Service/{sts['spec']['serviceName']}"]
    assert svc["spec"]["clusterIP"] == "None"  # headless: <sts>-K.<service> names
    n = sts["spec"]["replicas"]
    [container] = sts["spec"]["template"]["spec"]["containers"]
    by_name = {e["name"]: e for e in container["env"]}
    assert by_name["SHARDS"]["value"] == str(n)
    assert by_name["SHARD"]["valueFrom"]["fieldRef"]["fieldPath"] == \
        "metadata.labels['apps.kubernetes.io/pod-index']"
    for k in range(n):
        argv = kubelet_args(container, {"SHARD": str(k)})
        assert argv[0] == "rankboard"
        args = build_parser().parse_args(argv[1:])
        assert args.command == "broker" and args.shard == (k, n)
        assert args.curve_secret_key is not None
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    [claim] = sts["spec"]["volumeClaimTemplates"]
    assert mounts[claim["metadata"]["name"]] == str(args.data_dir)  # a volume per pod
    keys = next(v for v in sts["spec"]["template"]["spec"]["volumes"] if v["name"] == "keys")
    assert keys["secret"]["secretName"] == "rankboard-keys"
    assert str(args.curve_secret_key).startswith(mounts["keys"])
    assert str(args.curve_authorized).startswith(mounts["keys"])


def test_web_deployment_lists_every_shard_in_order() -> None:
    docs = manifests()
    sts = docs["StatefulSet/rankboard-broker"]
    n, service = sts["spec"]["replicas"], sts["spec"]["serviceName"]
    web = docs["Deployment/rankboard-web"]
    [container] = web["spec"]["template"]["spec"]["containers"]
    argv = kubelet_args(container, {})
    args = build_parser().parse_args(argv[1:])
    assert args.command == "web" and args.workers > 1
    names = [f"rankboard-broker-{k}.{service}" for k in range(n)]
    assert args.publish == ",".join(f"tcp://{h}:5586" for h in names)
    assert args.snapshot == ",".join(f"tcp://{h}:5587" for h in names)
    assert args.curve_client_key is not None and args.curve_server_key is not None
    assert "--token" not in argv
    token = {e["name"]: e for e in container["env"]}["RANKBOARD_TOKEN"]
    assert token["valueFrom"]["secretKeyRef"]  # from a Secret, never on the command line
    keys = next(v for v in web["spec"]["template"]["spec"]["volumes"] if v["name"] == "keys")
    assert keys["secret"]["secretName"] == "rankboard-keys"
