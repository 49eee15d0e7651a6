"""PROTOCOL 8.4 in deploy/: every broker the deploy files start bounds its data dir with
``--retain-bytes`` (a value the CLI takes), and the Kubernetes StatefulSet's bound fits its
journal volume with room to spare."""
from __future__ import annotations

import re

from broker.retention.plan import parse_size
from rankboard.cli import build_parser
from tests.deploy.test_shards_deploy import (
    SYSTEMD,
    env_file,
    kubelet_args,
    manifests,
    systemd_argv,
)
from tests.deploy.test_systemd import unit_settings

_QUANTITY = {"Ki": 1024, "Mi": 1024 ** 2, "Gi": 1024 ** 3, "Ti": 1024 ** 4}


def _quantity(text: str) -> int:
    m = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti)", text)
    assert m is not None, text
    return int(m.group(1)) * _QUANTITY[m.group(2)]


def test_every_systemd_shard_takes_the_env_files_bound() -> None:
    n = int(env_file(SYSTEMD / "rankboard-shards.env")["RANKBOARD_SHARDS"])
    bound = parse_size(env_file(SYSTEMD / "rankboard-shards.env")["RANKBOARD_RETAIN_BYTES"])
    for k in range(n):
        args = build_parser().parse_args(systemd_argv(k)[1:])
        assert args.retain_bytes == bound


def test_the_single_systemd_broker_is_bounded() -> None:
    [exec_start] = unit_settings("rankboard-broker.service")["ExecStart"]
    argv = exec_start.replace("%d", "/run/credentials/unit").split()
    args = build_parser().parse_args(argv[1:])
    assert args.retain_bytes is not None and args.retain_bytes > 0


def test_statefulset_bound_fits_its_volume() -> None:
    sts = manifests()["StatefulSet/rankboard-broker"]
    [container] = sts["spec"]["template"]["spec"]["containers"]
    args = build_parser().parse_args(kubelet_args(container, {"SHARD": "0"})[1:])
    [claim] = sts["spec"]["volumeClaimTemplates"]
    volume = _quantity(claim["spec"]["resources"]["requests"]["storage"])
    assert args.retain_bytes is not None
    # below the volume, leaving room for files being written (and set aside)
    assert 0.5 * volume <= args.retain_bytes <= 0.95 * volume
