"""Starting and stopping rankboard's own child processes.

Every child (``up``'s broker, a ``--workers`` web worker, a ``demo`` rank) is a fresh
interpreter running one of rankboard's modules, started by :func:`child_command` alone. A
plain ``python -m rankboard`` would put the current directory first on the child's
``sys.path``, so a user who runs ``rankboard up`` in a project holding its own ``broker/``
or ``web/`` package would have the child import *that* instead of ours. The child therefore
starts without the current directory on its path (``-P`` from Python 3.11; before it a
``-c`` bootstrap that drops ``sys.path[0]`` and runs the module with :mod:`runpy`) and finds
rankboard where this process found it: the directory holding our packages goes first on
``PYTHONPATH`` unless it is a site directory the child searches anyway.
"""
from __future__ import annotations

import os
import site
import sys
from pathlib import Path
from typing import Mapping, Sequence

from rank_agent.digits import is_ascii_digits
from web.children import terminate, terminate_all

__all__ = ["ROOT", "PARENT_ENV", "child_command", "die_with_parent", "terminate",
           "terminate_all"]

#: Set by a parent that owns its child (``up``'s broker) to its own pid: the child ends when
#: that parent ends, however it ends (:func:`die_with_parent`). Read once and removed, so a
#: grandchild never inherits a stale owner.
PARENT_ENV = "RANKBOARD_PARENT_PID"
#: Linux ``prctl`` option: the signal the kernel sends us when our parent thread dies.
PR_SET_PDEATHSIG = 1
#: Seconds between checks of the parent (the watch runs even where ``prctl`` is armed).
PARENT_POLL = 1.0
#: Seconds a clean stop may take once the parent is gone; then the process exits anyway.
PARENT_GRACE = 10.0

#: the directory holding rankboard's packages (rankboard, broker, web, rank_agent)
ROOT = Path(__file__).resolve().parent.parent

#: Python < 3.11 (no ``-P``): drop the script directory (the cwd for ``-c``) from the path,
#: then run the module named by the first argument as ``python -m`` would
_BOOTSTRAP = ("import runpy, sys; del sys.path[0]; "
              "runpy.run_module(sys.argv.pop(1), run_name='__main__', alter_sys=True)")


def _site_dirs() -> set[str]:
    dirs = set(site.getsitepackages()) if hasattr(site, "getsitepackages") else set()
    if site.ENABLE_USER_SITE:
        dirs.add(site.getusersitepackages())
    return {os.path.realpath(d) for d in dirs}


def child_command(module: str, args: Sequence[str], env: Mapping[str, str] | None = None, *,
                  safe_path_flag: bool | None = None) -> tuple[list[str], dict[str, str]]:
    """The command line and environment that run ``python -m module *args`` safely.

    ``env``: the child's environment before our change (default: ours).
    ``safe_path_flag``: use ``-P`` (default: on Python >= 3.11); False forces the
    bootstrap, which tests exercise on any version.
    """
    if safe_path_flag is None:
        safe_path_flag = sys.version_info >= (3, 11)
    if safe_path_flag:
        cmd = [sys.executable, "-P", "-m", module, *args]
    else:
        cmd = [sys.executable, "-c", _BOOTSTRAP, module, *args]
    child_env = dict(os.environ if env is None else env)
    root = str(ROOT)
    paths = [p for p in child_env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if os.path.realpath(root) not in _site_dirs() and root not in paths:
        child_env["PYTHONPATH"] = os.pathsep.join([root, *paths])
    return cmd, child_env


def die_with_parent(env: dict[str, str] | os._Environ[str] | None = None) -> bool:
    """End this process with SIGTERM when the parent named by :data:`PARENT_ENV` ends.

    ``rankboard up`` SIGKILLed cannot stop its broker, whose ports and data-dir lock would
    then stay held by an orphan (issue 19). On Linux the kernel delivers SIGTERM on the
    parent's death (``prctl(PR_SET_PDEATHSIG)``; the broker stops cleanly on it); elsewhere
    the watch thread sends it. The parent may already be gone by the time we get here: then
    we stop at once.

    The watch thread runs in both cases, because a SIGTERM only *asks*: once it sees the
    parent gone it gives the clean stop :data:`PARENT_GRACE` seconds, then ends the process
    with ``os._exit`` (a stop wedged anywhere must not leave the orphan this prevents).
    Returns True when a watch was set up."""
    import signal
    import threading
    import time

    env = os.environ if env is None else env
    raw = env.pop(PARENT_ENV, None)
    if not raw or not is_ascii_digits(raw):
        return False
    parent = int(raw)
    armed = False
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            armed = libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) == 0
        except (OSError, AttributeError):
            armed = False

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL)
        if not armed:
            os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(PARENT_GRACE)
        # Straight to fd 2, non-blocking: the stop may be wedged on that very stream (a full
        # pipe nobody reads holds sys.stderr's lock), and this line must not wait on it.
        try:
            os.set_blocking(2, False)
            os.write(2, f"rankboard: parent {parent} gone and the clean stop took over "
                        f"{PARENT_GRACE:g} s: exiting\n".encode())
        except OSError:
            pass
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
    if armed and os.getppid() != parent:  # it died before prctl: the kernel sent nothing
        os.kill(os.getpid(), signal.SIGTERM)
    return True
