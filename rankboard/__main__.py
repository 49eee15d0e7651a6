"""``python -m rankboard``: the ``rankboard`` command (see :mod:`rankboard.cli`).

The children rankboard starts run this module through
:func:`rankboard.process.child_command`, which keeps the current directory off their path.
"""
from __future__ import annotations

import sys

from rankboard.cli import main
from rankboard.process import die_with_parent

if __name__ == "__main__":
    die_with_parent()  # a child that its parent owns (``up``'s broker) ends with it
    sys.exit(main())
