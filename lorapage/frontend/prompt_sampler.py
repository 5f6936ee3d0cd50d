"""Check prompts sampled from an adapter's own traffic, for the adapters whose owner opted in.

An owner who sets ``sample_check_prompts`` (at registration, or ``sample`` through ``PUT
/v1/adapters/{id}/check_prompts``) lets the server keep a few of the adapter's recent prompts for
its base-upgrade drift check. On the event loop a request costs one set lookup and, now and then,
one list copy: each opted-in id has a uniform reservoir (Algorithm R, :class:`Reservoir`) of the
prompts seen since the last flush, as token ids. Every :data:`FLUSH_S` seconds (and when the server
closes) a worker thread decodes them to text, drops any over the size bound, and stores them in
the registry (:meth:`~lorapage.registry.store.Registry.add_sampled_prompts`), newest first, at
most :data:`~lorapage.registry.drift_state.MAX_SAMPLED_PROMPTS` per id. Text only, never logged;
turning sampling off deletes what was sampled.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from lorapage.registry.drift_state import MAX_PROMPT_BYTES, MAX_SAMPLED_PROMPTS

log = logging.getLogger("lorapage.server")

FLUSH_S = 60.0


@dataclass
class Reservoir:
    """A uniform sample of at most ``size`` items of those offered (Algorithm R)."""

    size: int
    items: list[list[int]] = field(default_factory=list)
    seen: int = 0

    def offer(self, item: Sequence[int], rng: random.Random) -> None:
        self.seen += 1
        if len(self.items) < self.size:
            self.items.append(list(item))
            return
        j = rng.randrange(self.seen)
        if j < self.size:
            self.items[j] = list(item)


class PromptSampler:
    """The opted-in ids and their reservoirs since the last flush (owned by the event loop)."""

    def __init__(self, enabled: Sequence[str] = (), rng: random.Random | None = None) -> None:
        self.enabled: set[str] = set(enabled)
        self._rng = rng or random.Random()
        self._pending: dict[str, Reservoir] = {}

    def set_enabled(self, adapter_id: str, on: bool) -> None:
        if on:
            self.enabled.add(adapter_id)
        else:
            self.enabled.discard(adapter_id)
            self._pending.pop(adapter_id, None)

    def offer(self, adapter_id: str, prompt: Sequence[int]) -> None:
        """A request's prompt (token ids) for ``adapter_id``: kept or not by the reservoir."""
        if adapter_id not in self.enabled or len(prompt) > MAX_PROMPT_BYTES:  # over the bound in any encoding
            return
        self._pending.setdefault(adapter_id, Reservoir(MAX_SAMPLED_PROMPTS)).offer(prompt, self._rng)

    async def flush(self, engine) -> int:
        """Store what was sampled since the last flush (decoded and written in a worker); returns
        the number of prompts stored."""
        pending, self._pending = self._pending, {}
        if not pending:
            return 0

        def write() -> int:
            stored = 0
            for adapter_id, reservoir in pending.items():
                texts = [_text(engine.tokenizer, ids) for ids in reservoir.items]
                texts = [t for t in texts if t.strip() and len(t.encode("utf-8", "surrogatepass")) <= MAX_PROMPT_BYTES]
                stored += engine.admin.catalog.drift_record.add_sampled_prompts(adapter_id, texts)
            return stored

        return await asyncio.get_running_loop().run_in_executor(None, write)

    async def run(self, engine, every_s: float = FLUSH_S) -> None:
        """Flush every ``every_s`` seconds until cancelled; a failed write is logged and dropped."""
        while True:
            await asyncio.sleep(every_s)
            try:
                await self.flush(engine)
            except Exception:
                log.exception("storing sampled check prompts failed")


def _text(tokenizer, ids: list[int]) -> str:
    """A prompt's text as the check will encode it again: special tokens kept (a chat template's
    markers), the BOS the encoder adds dropped."""
    if ids and tokenizer.bos_token_id is not None and ids[0] == tokenizer.bos_token_id:
        ids = ids[1:]
    return tokenizer.backend.decode(ids, skip_special_tokens=False)
