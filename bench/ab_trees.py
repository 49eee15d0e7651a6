"""Every figure of ``run_all.py``, this tree against another, alternated in one run: the A/B
a change to the broker or the agent owes (the brief: "A/B'd against main before it").

Each round runs ``bench/run_all.py`` (``--quick`` unless ``--full``; ``--only`` passed on)
once in each tree, this tree first in odd rounds and the other first in even ones, each with
its own code (the other tree is a ``git worktree`` of ``--base`` in a temporary directory,
``PYTHONPATH`` pointed at it). A figure's ``ratio`` is the median of this tree's values over
the median of the base's; ``worse`` says whether that is the wrong way for the figure (by its
unit: higher is better for rates and ratios, lower for times, sizes and counts). Figures present in one tree only are listed without a ratio. On a shared
machine a figure moves by tens of percent between rounds: read the ratio with its rounds.

    python bench/ab_trees.py --base 128e9f0 --rounds 2
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from common import REPO

#: units whose larger value is better (the rest: smaller is better)
HIGHER_IS_BETTER = ("ratio", "x")


def run_all(root: Path, extra: list[str]) -> dict[str, float]:
    """One ``run_all.py`` in the tree at ``root``: figure name -> value."""
    env = dict(os.environ, PYTHONPATH=str(root))
    proc = subprocess.run([sys.executable, str(root / "bench" / "run_all.py"), *extra],
                          cwd=root, env=env, capture_output=True, text=True, timeout=3600)
    out: dict[str, float] = {}
    for line in proc.stdout.splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("value"), (int, float)):
            out[str(row.get("name"))] = float(row["value"])
            out["unit:" + str(row.get("name"))] = row.get("unit")  # type: ignore[assignment]
    if proc.returncode != 0:
        print(f"# run_all in {root} exited {proc.returncode}: {proc.stderr[-400:]}",
              file=sys.stderr)
    return out


def higher_is_better(unit: Any) -> bool:
    """Rates (``.../s``) and ratios: larger is better; times, sizes and counts: smaller."""
    text = str(unit or "")
    return text.endswith("/s") or text in HIGHER_IS_BETTER


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", default="main", help="the other tree's revision (default main)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--only", default="", help="run_all.py's --only")
    p.add_argument("--full", action="store_true", help="run_all.py without --quick")
    args = p.parse_args()
    extra = [] if args.full else ["--quick"]
    if args.only:
        extra += ["--only", args.only]
    extra += ["--markdown", os.devnull]
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "--quiet",
                        str(base), args.base], check=True)
        try:
            mine: list[dict[str, float]] = []
            theirs: list[dict[str, float]] = []
            for r in range(args.rounds):
                order = [(REPO, mine), (base, theirs)]
                for root, into in (order if r % 2 == 0 else order[::-1]):
                    into.append(run_all(root, extra))
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(base)],
                           check=False)
    names = sorted({k for d in mine + theirs for k in d if not k.startswith("unit:")})
    for name in names:
        a = [d[name] for d in mine if name in d]
        b = [d[name] for d in theirs if name in d]
        unit = next((d.get("unit:" + name) for d in mine + theirs if "unit:" + name in d), "")
        row: dict[str, Any] = {"name": name, "unit": unit, "this": a, "base": b}
        if a and b and statistics.median(b):
            ratio = statistics.median(a) / statistics.median(b)
            row["ratio"] = round(ratio, 3)
            row["worse"] = ratio < 1 if higher_is_better(unit) else ratio > 1
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
