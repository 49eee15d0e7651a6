"""``python -m rankboard``: the ``rankboard`` command (see :mod:`rankboard.cli`).

The current directory is dropped from ``sys.path`` (unless it is where rankboard's packages
live): ``python -m`` puts it first, and a user's own ``broker/`` or ``web/`` package there
must not stand in for ours. Children are started the same way (:mod:`rankboard.process`).
"""
from __future__ import annotations

import os
import sys

from rankboard.process import ROOT


def _drop_cwd() -> None:
    if sys.path and sys.path[0] in ("", os.getcwd()) and (
            os.path.realpath(sys.path[0] or ".") != os.path.realpath(ROOT)):
        del sys.path[0]


if __name__ == "__main__":
    _drop_cwd()
    from rankboard.cli import main

    sys.exit(main())
