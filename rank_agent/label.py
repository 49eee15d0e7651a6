"""The run's readable name, the ``register`` frame's ``label`` (PROTOCOL.md section 7.5).

Plain ``torchrun`` names every job with a random UUID (``TORCHELASTIC_RUN_ID``): a good run id,
since all ranks share it, but a poor name on a page of runs. So every ``register`` carries a
label, and when the caller names none the agent picks one the user will recognise: the
framework's own name where it has one (an integration passes it), else the training script's.
Pure: reads ``__main__`` and ``sys.argv``, imports no framework.
"""
from __future__ import annotations

import os
import sys
from types import ModuleType
from typing import Optional, Sequence

from .protocol import MAX_LABEL

#: ``__main__`` modules that are a shell or a notebook, not a training script.
_INTERACTIVE = frozenset({"ipykernel_launcher", "IPython", "code", "idlelib.idle"})


def script_label(main: Optional[ModuleType] = None,
                 argv: Optional[Sequence[str]] = None) -> str:
    """The training script's name: ``train.py`` -> ``train``; ``python -m pkg.train`` ->
    ``pkg.train`` (a package's ``__main__`` names the package); ``""`` for an interactive
    interpreter (``python``, ``python -c``, a notebook), which has no script to name."""
    if main is None:
        main = sys.modules.get("__main__")
    argv = sys.argv if argv is None else argv
    spec = getattr(main, "__spec__", None)
    name = getattr(spec, "name", None)
    if isinstance(name, str) and name and name != "__main__":
        if name.endswith(".__main__"):
            name = name[: -len(".__main__")]
        return "" if name in _INTERACTIVE else name
    first = argv[0] if argv else ""
    if not first or first in ("-c", "-") or hasattr(sys, "ps1"):
        return ""
    base = os.path.basename(first)
    return base[:-3] if base.endswith(".py") else base


def resolve_label(label: Optional[str], default: Optional[str] = None) -> str:
    """The label an agent sends: ``label`` when given (``""`` = none), else ``default`` (the
    framework's name), else :func:`script_label`; cut to 128 characters, since the broker
    rejects a longer one and a name must never cost the run its frames."""
    if label is None:
        label = default if default else script_label()
    text = str(label)
    return text[:MAX_LABEL]
