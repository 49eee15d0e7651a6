"""Fixtures for the deploy tests: the files under ``deploy/`` checked by the tools they are
written for (systemd-analyze, promtool, nginx, bash), found on the machine.

A missing tool skips its tests on a developer's machine and fails them under CI, which
installs every one (``.ci/run``): a skip there would hide lost coverage.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.web.conftest import broker, pusher, spawn  # noqa: F401  (fixtures re-exported)

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
#: where Debian puts daemons a plain user's PATH may lack (nginx)
EXTRA_PATH = ("/usr/sbin", "/sbin")


def tool(name: str, package: str) -> str:
    """The path of the executable ``name`` (from Debian's ``package``), or skip/fail."""
    found = shutil.which(name) or shutil.which(name, path=os.pathsep.join(EXTRA_PATH))
    if found:
        return found
    missing = f"{name} (apt-get install {package})"
    if os.environ.get("CI"):
        pytest.fail(f"CI must have {missing}; .ci/run installs it")
    pytest.skip(f"needs {missing}")
