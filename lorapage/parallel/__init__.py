"""Tensor parallelism: one engine (rank 0, the event loop's process) driving worker ranks that
each hold a shard of the base, of the KV pages and of every resident adapter (docs/parallel.md)."""

from lorapage.parallel.group import TensorParallelGroup
from lorapage.parallel.shards import check_tensor_parallel, shard_config

__all__ = ["TensorParallelGroup", "check_tensor_parallel", "shard_config"]
