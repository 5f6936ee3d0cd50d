"""What the ingress and the engine replicas send each other over Ray: plain picklable records.

Kept free of Ray imports so the records (and their tests) load without the ``[fleet]`` extra.
"""

from __future__ import annotations

from dataclasses import dataclass

from lorapage.sampling_params import SamplingParams


@dataclass(frozen=True)
class EngineJob:
    """One request for an engine replica: its prompt already tokenized and checked by the ingress."""

    prompt: list[int]
    adapter: str | None
    sampling: SamplingParams
    tenant: str
    request_id: str


@dataclass(frozen=True)
class ReplicaStart:
    """The first item of every replica stream: which replica (Ray's replica id) took the request,
    and the adapter version (``N`` of ``id@N``) it resolved the request to (None: the base)."""

    replica_id: str
    adapter_version: int | None = None


@dataclass(frozen=True)
class EngineProfile:
    """What the ingress needs to know of the engines before it can check a request."""

    base_name: str
    max_model_len: int
    vocab_size: int
