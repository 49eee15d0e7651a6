"""rankboard's children find rankboard, not what the user's current directory holds.

``rankboard up`` run in a project that has its own ``broker/`` and ``web/`` packages (both
plain names) must still start its broker child and its web workers from rankboard's
packages: :func:`rankboard.process.child_command` keeps the current directory off a child's
``sys.path``. Everything here runs from such a directory, whose packages raise on import,
with rankboard reachable only through ``PYTHONPATH`` (it is not installed in the test venv),
and the top command started as the installed console script runs it (a script file, whose
directory, not the current one, heads ``sys.path``).
"""
from __future__ import annotations

import http.client
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from rankboard.process import child_command
from tests.support.polling import wait_for

REPO = Path(__file__).resolve().parent.parent
HOSTILE = ("broker", "web", "rank_agent")
#: what pip writes as the ``rankboard`` console script (setup.cfg: rankboard.cli:main)
CONSOLE_SCRIPT = "import sys\nfrom rankboard.cli import main\nsys.exit(main())\n"


@pytest.fixture
def hostile(tmp_path: Path) -> Path:
    """A user's project directory whose ``broker``, ``web`` and ``rank_agent`` packages
    raise on import."""
    project = tmp_path / "project"
    for name in HOSTILE:
        (project / name).mkdir(parents=True)
        (project / name / "__init__.py").write_text(
            f"raise ImportError('the user\\'s own {name} package was imported')\n")
    return project


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO))
    env.pop("RANKBOARD_TOKEN", None)
    return env


def test_a_plain_python_m_child_would_import_the_users_package(hostile: Path) -> None:
    """The control: without child_command the hostile package wins."""
    done = subprocess.run([sys.executable, "-m", "rankboard", "keys", str(hostile / "k")],
                          cwd=hostile, env=_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "the user's own broker package was imported" in done.stderr


@pytest.mark.parametrize("safe_path_flag", [True, False], ids=["-P", "bootstrap"])
def test_child_command_ignores_the_current_directory(hostile: Path,
                                                     safe_path_flag: bool) -> None:
    """Both ways (``-P`` on 3.11+, the ``-c`` bootstrap before): ``rankboard keys`` imports
    ``rankboard.keys``; the child's ``PYTHONPATH`` starts with rankboard's directory even when
    ours does not name it."""
    env = _env()
    env.pop("PYTHONPATH")
    cmd, child_env = child_command("rankboard", ["keys", str(hostile / "k")], env,
                                   safe_path_flag=safe_path_flag)
    assert child_env["PYTHONPATH"].split(os.pathsep)[0] == str(REPO)
    done = subprocess.run(cmd, cwd=hostile, env=child_env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert (hostile / "k" / "server.key_secret").is_file()


def _get(port: int, path: str) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", path)
        return conn.getresponse().status
    finally:
        conn.close()


@pytest.mark.parametrize("workers", [1, 2])
def test_up_in_a_directory_holding_its_own_broker_and_web(hostile: Path, tmp_path: Path,
                                                          workers: int) -> None:
    """The broker child (and with ``--workers 2`` the web workers) start and serve."""
    script = tmp_path / "bin" / "rankboard"
    script.parent.mkdir()
    script.write_text(CONSOLE_SCRIPT)
    proc = subprocess.Popen(
        [sys.executable, str(script), "up", "--port", "0", "--workers", str(workers),
         "--ingest", "tcp://127.0.0.1:*", "--publish", "tcp://127.0.0.1:*",
         "--snapshot", "tcp://127.0.0.1:*", "--data-dir", str(tmp_path / "data")],
        cwd=hostile, env=_env(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    out: list[str] = []
    err: list[str] = []
    readers = [threading.Thread(target=lambda s=s, sink=sink: sink.extend(s), daemon=True)
               for s, sink in ((proc.stdout, out), (proc.stderr, err))]
    for reader in readers:
        reader.start()
    try:
        def dashboard() -> int | None:
            assert proc.poll() is None, "".join(err)
            for line in list(out):
                m = re.match(r"dashboard: http://localhost:(\d+)", line)
                if m:
                    return int(m.group(1))
            return None

        port = wait_for(dashboard, timeout=60, what="the dashboard line")
        wait_for(lambda: _get(port, "/healthz") == 200, timeout=30, what="a healthy web",
                 retry_on=(OSError,))
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for reader in readers:
            reader.join(timeout=5)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
    assert "Traceback" not in "".join(err), "".join(err)
    assert "the user's own" not in "".join(err)
