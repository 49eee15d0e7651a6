"""Framework integrations: one line in a training script instead of a hand-written loop.

* :mod:`rank_agent.integrations.lightning`: ``RankboardCallback`` for ``lightning.pytorch``;
* :mod:`rank_agent.integrations.transformers`: ``RankboardCallback`` for the Hugging Face
  ``Trainer``;
* :mod:`rank_agent.integrations.accelerate`: ``RankboardTracker`` for ``accelerate``.

Importing this package imports no framework (nor torch): each submodule imports its own
framework, so only the one a script uses is loaded, and none of them is a dependency of
``rank_agent`` (``pip install rankboard[lightning]`` and friends bring them).
"""
