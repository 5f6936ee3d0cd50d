"""Tensor parallelism: one engine (rank 0, the event loop's process) driving worker ranks that
each hold a shard of the base, of the KV pages and of every resident adapter (docs/parallel.md)."""

from typing import TYPE_CHECKING

from lorapage._exports import lazy

if TYPE_CHECKING:
    from lorapage.parallel.group import (
        TensorParallelError as TensorParallelError,
        TensorParallelGroup as TensorParallelGroup,
    )
    from lorapage.parallel.shards import (
        check_tensor_parallel as check_tensor_parallel,
        shard_config as shard_config,
    )

__getattr__, __dir__, __all__ = lazy(
    __name__,
    {
        "TensorParallelError": "lorapage.parallel.group",
        "TensorParallelGroup": "lorapage.parallel.group",
        "check_tensor_parallel": "lorapage.parallel.shards",
        "shard_config": "lorapage.parallel.shards",
    },
)
