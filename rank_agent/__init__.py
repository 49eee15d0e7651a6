"""rank_agent: the part of rankboard that runs inside training processes.

``from rank_agent import RankAgent`` (PROTOCOL.md section 5). Importing this package loads
only pyzmq, msgspec and psutil: never gevent, Flask or torch, and it never creates a CUDA
context (the sampler reads GPUs through NVML, imported lazily).
"""
from .agent import RankAgent, sanitize_run_id
from .sampler import Sampler

__all__ = ["RankAgent", "Sampler", "sanitize_run_id"]
