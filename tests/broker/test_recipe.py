"""The README's recipe runs as written: the README prints ``examples/recipe.py`` exactly,
and that script, run as a real process against a real broker, makes one complete run with
its epochs, its steps and the script's name as its label."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Callable

from tests.support.brokers import FeedClient, RunningBroker
from tests.support.polling import wait_for

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "examples" / "recipe.py"


def test_the_readme_prints_the_recipe_file_exactly() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("## Use it in your training script"):]
    block = re.search(r"```python\n(.*?)```\n", section, re.S)
    assert block is not None
    code = RECIPE.read_text(encoding="utf-8")
    assert block.group(1) == code[code.index("import random"):]


def test_the_recipe_runs_against_a_real_broker(start_broker: Callable[..., RunningBroker],
                                               ctx) -> None:
    broker = start_broker()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RANKBOARD_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_",
                                "TORCHELASTIC_", "MASTER_"))}
    env.update(RANKBOARD_BROKER=broker.endpoints["ingest"], RANKBOARD_RUN="readme-recipe",
               PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, str(RECIPE)], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    client = FeedClient(ctx, broker.endpoints["publish"], broker.endpoints["snapshot"])
    try:
        def complete() -> dict | None:
            runs, _ = client.snapshot("readme-recipe")
            header = runs[0]["header"] if runs else None
            return header if header and header["status"] == "complete" else None

        header = wait_for(complete, 20.0, "the recipe's run complete")
    finally:
        client.close()
    assert header["label"] == "recipe" and header["world_size"] == 1
    assert header["total_epochs"] == 3 and header["steps_done"] == 149
    assert header["step_metrics"] == ["loss"]
