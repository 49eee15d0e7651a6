"""Checks a command makes before it starts anything: a bad ``--data-dir`` must be one line
and exit status 2 before the dashboard's URL is printed, not a URL and then a broker that
dies a second later."""
from __future__ import annotations

from pathlib import Path


def data_dir_problem(path: Path | None) -> str | None:
    """Why ``path`` cannot be a data dir (a file, or under one), or None. A missing dir is
    fine (the broker creates it); permissions are the broker's own one-line error."""
    if path is None:
        return None
    path = Path(path).expanduser()
    if path.exists():
        return None if path.is_dir() else f"--data-dir {path} is a file, not a directory"
    for parent in path.parents:
        if parent.exists():
            return None if parent.is_dir() else f"--data-dir {path}: {parent} is a file, not a directory"
    return None
