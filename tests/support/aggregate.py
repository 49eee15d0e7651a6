"""Test helpers over :mod:`broker.run.aggregate` that the broker itself has no use for (issue 44
item 4: they lived in the package, used only by tests)."""
from __future__ import annotations

from typing import Any, Dict, Mapping

from broker.run.aggregate import Placement, rank_gpu
from rank_agent.protocol import ResourceSample


def gpu_entries(samples: Mapping[int, ResourceSample], placement: Mapping[int, Placement]
                ) -> Dict[int, Dict[str, Any]]:
    """rank -> its relabelled first GPU, for every rank whose sample has a GPU: built from
    scratch, where the sink keeps the map up to date as samples and registers arrive."""
    return {rank: rank_gpu(rank, placement.get(rank), s.gpus[0])
            for rank, s in samples.items() if s.gpus}
