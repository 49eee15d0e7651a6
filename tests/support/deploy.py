"""The files under ``deploy/`` and the tools that check them (systemd-analyze, promtool,
nginx, bash), found on the machine.

A missing tool skips its tests on a developer's machine and fails them under CI, which
installs every one (``.ci/run``): a skip there would hide lost coverage.
"""
from __future__ import annotations

import os
import shutil

import pytest

from tests.support import REPO

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
