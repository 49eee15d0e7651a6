"""What to say about a flag a subcommand does not know (``rankboard up --prot 8000``).

argparse reports extras from the top-level parser ("rankboard: unrecognized arguments"),
which sends the reader to ``rankboard --help``: the list of commands, not the flag they
mistyped. This names the subcommand, the closest flag it has, and its own ``--help``.
"""
from __future__ import annotations

import argparse
import difflib
from typing import Sequence


def subcommand_parser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser | None:
    """The parser of subcommand ``name`` (None when there is none)."""
    for action in parser._actions:  # argparse keeps subparsers only here
        if isinstance(action, argparse._SubParsersAction):
            found = action.choices.get(name)
            return found if isinstance(found, argparse.ArgumentParser) else None
    return None


def unknown_flags_message(sub: argparse.ArgumentParser, extras: Sequence[str]) -> str:
    """One line: ``rankboard up: unknown flag --prot (did you mean --port?); see rankboard up
    --help``. Values after an unknown flag are left out of the line (they are its value)."""
    flags = [e for e in extras if e.startswith("-")] or list(extras)
    known = [o for a in sub._actions for o in a.option_strings if o.startswith("--")]
    parts = []
    for flag in flags:
        name = flag.split("=", 1)[0]
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.75)
        parts.append(f"{name} (did you mean {close[0]}?)" if close else name)
    what = "unknown flag" if len(parts) == 1 else "unknown flags"
    return f"{sub.prog}: {what} {', '.join(parts)}; see {sub.prog} --help"
