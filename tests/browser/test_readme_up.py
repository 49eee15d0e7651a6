"""The README's second step as a newcomer types it (PROTOCOL 8.5, issue 37): ``rankboard
up``, then ``python examples/recipe.py``, then http://localhost:8585 shows the run.

Not a bare broker and not ephemeral ports: the README's own commands and address, so a
``rankboard up`` that binds nowhere until a rank names a port (the v1 rule, which the
recipe never triggers) fails here. The default ports are taken under a machine-wide lock
(:mod:`tests.support.defaultports`); the data dir is the default one under a private
``XDG_STATE_HOME``, so the command line stays exactly the README's.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import expect

from tests.support import REPO
from tests.support.defaultports import default_ports
from tests.support.http import fetch
from tests.support.polling import wait_for
from tests.support.procs import Proc

pytestmark = pytest.mark.browser

#: What a rank's environment must not carry for the recipe to run as on a newcomer's shell.
_LAUNCHER_VARS = ("RANKBOARD_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_", "TORCHELASTIC_",
                  "MASTER_")


def _readme_commands() -> tuple[str, str, str]:
    """(the start command, the script command, the address) as the README prints them."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("## Use it in your training script"):]
    m = re.search(r"\(`(rankboard up)`, then open (http://localhost:\d+)\)", section)
    assert m is not None, "the README no longer says `rankboard up`, then open http://localhost:..."
    run = re.search(r"`(python examples/recipe\.py)` is a one-rank run", section)
    assert run is not None
    return m.group(1), run.group(1), m.group(2)


def test_rankboard_up_then_the_recipe_then_the_page_at_8585(tmp_path: Path, page: Any) -> None:
    start, script, address = _readme_commands()
    assert address == "http://localhost:8585"
    port = int(address.rsplit(":", 1)[1])
    with default_ports():
        up = Proc(start.split()[1:], {"XDG_STATE_HOME": str(tmp_path / "state")})
        try:
            # bound at once, before any rank exists: the README's address answers
            up.wait_line(rf"^dashboard: http://localhost:{port}$", timeout=60.0)
            wait_for(lambda: fetch(port, "/healthz").status == 200, 30.0, "the web's /healthz")
            env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCHER_VARS)}
            env["PYTHONPATH"] = str(REPO)
            done = subprocess.run([sys.executable, *script.split()[1:]], env=env, cwd=REPO,
                                  capture_output=True, text=True, timeout=180)
            assert done.returncode == 0, done.stderr
            assert "rankboard up" not in done.stderr, done.stderr  # its "frames went nowhere"
            page.goto(f"{address}/")
            expect(page.locator("#run-name")).to_have_text("recipe", timeout=30_000)
            expect(page.locator("#status-text")).to_have_text("complete", timeout=30_000)
            expect(page.locator("#epoch-count")).to_have_text("3/3")
            page.errors.check()
            up.proc.send_signal(signal.SIGINT)
            assert up.proc.wait(30) == 0
            assert "Traceback" not in up.output()
        finally:
            up.close()
