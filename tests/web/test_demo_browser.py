"""``rankboard demo`` opens the dashboard in the user's browser where there is one, and the
access log never carries a ``?token=`` credential."""
from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Any

from tests.support.http import fetch
from tests.support.polling import wait_for
from web.httpguard import redact_token


def _browser_env(tmp_path: Path) -> tuple[dict[str, str], Path]:
    opened = tmp_path / "opened.txt"
    script = tmp_path / "fake-browser.py"
    script.write_text(f"import sys\nopen({str(opened)!r}, 'a').write(sys.argv[1] + '\\n')\n")
    # webbrowser runs $BROWSER with %s replaced by the URL: a real process, recording it.
    return {"BROWSER": f"{sys.executable} {script} %s", "DISPLAY": ":99"}, opened


def test_demo_opens_the_dashboard_in_a_browser(spawn: Any, tmp_path: Path) -> None:
    env, opened = _browser_env(tmp_path)
    demo = spawn("demo", "--port", "0", "--ranks", "2", "--hosts", "1", "--epochs", "2",
                 "--epoch-seconds", "0.3", env=env)
    port = demo.wait_dashboard(timeout=30)
    url = wait_for(lambda: opened.exists() and opened.read_text().strip(), timeout=20,
                   what="the browser to be asked to open the dashboard")
    assert url == f"http://localhost:{port}/"
    assert demo.stop(signal.SIGINT, timeout=20) == 0


def test_demo_no_browser_flag(spawn: Any, tmp_path: Path) -> None:
    env, opened = _browser_env(tmp_path)
    demo = spawn("demo", "--port", "0", "--ranks", "2", "--hosts", "1", "--epochs", "2",
                 "--epoch-seconds", "0.3", "--no-browser", env=env)
    port = demo.wait_dashboard(timeout=30)
    wait_for(lambda: fetch(port, "/healthz").status == 200, what="healthz")
    assert demo.stop(signal.SIGINT, timeout=20) == 0
    assert not opened.exists()


def test_token_is_redacted_from_access_log_lines() -> None:
    line = '127.0.0.1 - - [x] "GET /api/runs?a=1&token=s3cret&b=2 HTTP/1.1" 200 2 0.001'
    assert "s3cret" not in redact_token(line)
    assert "token=<redacted>&b=2" in redact_token(line)
    assert redact_token('"GET /?TOKEN=abc HTTP/1.1"') == '"GET /?TOKEN=<redacted> HTTP/1.1"'


def test_access_log_of_a_real_server_has_no_token(spawn: Any, broker: Any) -> None:
    from tests.support.procs import start_web

    web = start_web(spawn, broker, "--token", "s3cret-token", "-v")
    assert fetch(web.port, "/api/runs?token=s3cret-token").status == 200
    wait_for(lambda: "/api/runs?token=" in web.output(), timeout=10, what="the access log line")
    assert "s3cret-token" not in web.output()
