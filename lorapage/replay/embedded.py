"""The ``--embedded`` target: an :class:`~lorapage.Engine` in this process, driven through
``Engine.generate`` exactly as the server's handlers drive it, with no HTTP in between.

Refusals are recorded with the status the server would answer (404 unknown adapter, 400, 503...).
Server-side counters come from the same Prometheus collectors the server exports, read in-process.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lorapage.engine import Engine
from lorapage.errors import AdapterNotFoundError, LorapageError
from lorapage.frontend.metrics import ServerMetrics
from lorapage.replay.prompts import DEFAULT_TOKEN_RANGE, prompt_for
from lorapage.replay.scrape import parse_prometheus
from lorapage.sampling_params import SamplingParams
from lorapage.traces.records import HTTP_ERROR, OK, STREAM_ERROR, Result
from lorapage.traces.trace import TraceRequest


class EmbeddedTarget:
    """Runs each request on ``engine`` (the caller owns it and closes it)."""

    def __init__(self, engine: Engine, *, token_range: tuple[int, int] = DEFAULT_TOKEN_RANGE) -> None:
        self.engine = engine
        self.token_range = token_range
        self.metrics_note: str | None = None
        self._metrics = ServerMetrics(engine.stats, engine.metrics().scheduler)

    def describe(self) -> dict[str, Any]:
        c = self.engine.config
        return {
            "kind": "embedded",
            "model": c.model,
            "adapters": len(self.engine.admin.served()),
            "config": {k: getattr(c, k) for k in ("max_loras", "max_cpu_loras", "max_num_seqs", "scheduler", "dtype")}
            | {"lora_dtype": c.resolved_lora_dtype, "max_resident_loras": self.engine.stats().lora_slots},
            "device": str(self.engine.device),
        }

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    def adapter_named(self, model: str) -> str | None:
        """The adapter ``model`` names (``None``: the base), as the server resolves it."""
        base = self.engine.base_name
        if model == base:
            return None
        prefix, sep, name = model.rpartition(":")
        if sep and prefix != base:
            raise AdapterNotFoundError(f"the model {model!r} does not exist", param="model")
        return name

    async def send(self, req: TraceRequest, index: int, res: Result, clock: Callable[[], float]) -> None:
        try:
            adapter = self.adapter_named(req.model)
            sampling = SamplingParams(max_tokens=req.max_tokens, **_sampling(req))
            outputs = self.engine.generate(
                prompt_for(req, index, self.token_range), adapter, sampling, tenant=req.tenant
            )
            async for out in outputs:
                if not res.status:
                    res.status, res.tier, res.prompt_tokens = 200, out.adapter_tier, len(out.prompt_token_ids)
                if len(out.token_ids) > res.output_tokens:
                    res.chunk(clock(), len(out.token_ids))
                if out.finish_reason == "abort":
                    res.outcome, res.error = STREAM_ERROR, "aborted by the engine"
            res.outcome = res.outcome or OK
        except LorapageError as exc:
            res.outcome = STREAM_ERROR if res.status else HTTP_ERROR
            res.status = res.status or exc.status
            res.error = exc.message[:300]
        finally:
            res.end = clock()

    async def counters(self) -> dict[str, float]:
        return parse_prometheus(self._metrics.render().decode())

    async def gauges(self) -> dict[str, float]:
        stats = self.engine.stats()
        return {"queue_depth": stats.queue_depth, "running": stats.running}


def _sampling(req: TraceRequest) -> dict:
    fields = req.sampling_fields()
    if "stop" in fields:
        fields["stop"] = tuple(fields["stop"])
    return fields
