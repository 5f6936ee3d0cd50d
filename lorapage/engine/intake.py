"""Turning a caller's prompt and parameters into a :class:`~lorapage.request.Request`, or a
specific error: every check a request passes before it may queue.

Cheap checks come first; text is tokenized in a worker thread and only once a bound on its
characters says it could fit, so an untrusted prompt never holds the event loop.
"""

from __future__ import annotations

import asyncio
import itertools
import struct
import uuid
from collections.abc import Callable, Collection
from concurrent.futures import Executor

import torch

from lorapage.adapters.cache import AdapterCache
from lorapage.config import DEFAULT_TENANT
from lorapage.errors import AdapterNotFoundError, EngineOverloadedError, InvalidRequestError, PromptTooLongError
from lorapage.memory.kv import blocks_needed
from lorapage.memory.pool import PagePool
from lorapage.memory.prefix_cache import block_keys
from lorapage.model.tokenizer import IncrementalDecoder, NoText, Tokenizer
from lorapage.request import Detokenizer, Request
from lorapage.sampling_params import SamplingParams
from lorapage.structured.grammars import Constraint, GrammarCompiler


class RequestIntake:
    """Validates and builds requests for one engine (its tokenizer, context, pool and adapters)."""

    def __init__(
        self,
        *,
        tokenizer: Tokenizer,
        vocab_size: int,
        max_model_len: int,
        block_size: int,
        max_queue_len: int,
        pool: PagePool,
        adapters: AdapterCache,
        num_waiting: Callable[[], int],
        in_flight: Collection[str],
        tokenize: Executor,
        clock: Callable[[], float],
        eos_token_ids: Collection[int] = (),
        grammars: GrammarCompiler | None = None,
        prefix_namespace: bytes | None = None,
    ) -> None:
        self.tokenizer, self.vocab_size, self.max_model_len = tokenizer, vocab_size, max_model_len
        self.block_size, self.max_queue_len = block_size, max_queue_len
        self.pool, self.adapters, self._num_waiting, self._in_flight = pool, adapters, num_waiting, in_flight
        self._tokenize, self._clock = tokenize, clock
        self._eos = tuple(sorted(eos_token_ids))
        self._grammars = grammars
        self._base_namespace = prefix_namespace  # None: prefix caching is off
        self._ids = itertools.count()

    def weights_changed(self, tag: bytes) -> None:
        """The base's weights changed (an adapter merged into them): prefix-cache blocks computed
        before never match a later prompt (their keys are under the old namespace)."""
        if self._base_namespace is not None:
            self._base_namespace += b"|weights|" + tag

    def check(self, adapter: str | None, sampling: SamplingParams) -> None:
        """What can be refused before the prompt is even looked at."""
        if not isinstance(sampling, SamplingParams):
            raise InvalidRequestError("sampling must be a SamplingParams", param="sampling")
        if adapter is not None and adapter not in self.adapters.entries:
            raise AdapterNotFoundError(f"adapter {adapter!r} does not exist", param="model")
        vocab = self.vocab_size
        for name, ids in (
            ("stop_token_ids", sampling.stop_token_ids),
            ("logit_bias", [t for t, _ in sampling.logit_bias]),
            ("allowed_token_ids", sampling.allowed_token_ids or ()),
        ):
            if any(t >= vocab for t in ids):
                raise InvalidRequestError(f"{name}: token ids must be below the vocabulary size {vocab}", param=name)
        if sampling.structured is not None and self._grammars is None:
            raise InvalidRequestError("this engine has no structured-output support", param=sampling.structured.param)

    async def constraints(self, sampling: SamplingParams, tenant: str | None) -> list[Constraint | None]:
        """The structured-output constraint of each of a request's ``n`` branches: one compile
        (in ``tenant``'s turn on the grammar threads), a copy per branch."""
        if sampling.structured is None or self._grammars is None:
            return [None] * sampling.n
        return list(await self._grammars.constraints(sampling.structured, sampling.n, tenant or ""))

    async def bad_words_ids(self, sampling: SamplingParams) -> tuple[tuple[int, ...], ...]:
        """Each bad word's token ids, as it would start the text and after a space (vLLM's rule)."""
        if not sampling.bad_words:
            return ()

        def encode() -> tuple[tuple[int, ...], ...]:
            out: dict[tuple[int, ...], None] = {}
            for word in sampling.bad_words:
                for text in (word, " " + word.lstrip()):
                    ids = tuple(self.tokenizer.encode(text, add_special_tokens=False))
                    if ids:
                        out[ids] = None
            return tuple(out)

        return await asyncio.get_running_loop().run_in_executor(self._tokenize, encode)

    async def prompt_ids(self, prompt: str | list[int]) -> list[int]:
        """Token ids of ``prompt``: text is bounded by its characters, then tokenized off the loop."""
        if not isinstance(prompt, str):
            return list(prompt)
        per_token = self.tokenizer.max_chars_per_token
        limit = self.max_model_len * per_token
        if len(prompt) > limit:
            raise PromptTooLongError(
                f"the prompt is {len(prompt)} characters; a context of {self.max_model_len} tokens holds at most "
                f"{limit} ({per_token} per token at most): shorten the prompt",
                param="prompt",
            )
        return await asyncio.get_running_loop().run_in_executor(self._tokenize, self.tokenizer.encode, prompt)

    def build(
        self,
        ids: list[int],
        adapter: str | None,
        sampling: SamplingParams,
        tenant: str | None,
        request_id: str | None,
        prefix_group: str | None = None,
        *,
        constraint: Constraint | None = None,
        bad_words_ids: tuple[tuple[int, ...], ...] = (),
    ) -> Request:
        """The request, once its ids fit the vocabulary, the context and the pool beside its adapter.
        Its cached prefix blocks are shared with ``prefix_group``'s requests, or without one with
        its tenant's only."""
        self.check(adapter, sampling)  # again: the adapter may have gone while the prompt was tokenized
        if request_id is not None and request_id in self._in_flight:
            raise InvalidRequestError(f"request_id {request_id!r} is already in flight", param="request_id")
        if sampling.truncate_prompt_tokens is not None:
            ids = ids[-sampling.truncate_prompt_tokens :]
        if not ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        vocab = self.vocab_size
        if not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
            raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab})", param="prompt")
        total = len(ids) + sampling.max_tokens
        if total > self.max_model_len:
            raise PromptTooLongError(
                f"prompt ({len(ids)} tokens) plus max_tokens ({sampling.max_tokens}) exceeds the "
                f"context of {self.max_model_len} tokens; shorten the prompt or lower max_tokens",
                param="max_tokens" if len(ids) < self.max_model_len else "prompt",
            )
        # The request's adapter stays resident beside its KV for its whole life (it runs on it).
        adapter_pages = self.adapters.get(adapter).layout.num_pages if adapter is not None else 0
        if blocks_needed(total, self.block_size) + adapter_pages > self.pool.capacity:
            raise PromptTooLongError(
                f"prompt plus max_tokens needs {total} tokens of KV; the whole pool "
                f"holds {(self.pool.capacity - adapter_pages) * self.block_size} beside the adapter",
                param="max_tokens",
            )
        if self._num_waiting() >= self.max_queue_len:
            raise EngineOverloadedError(f"the queue holds {self.max_queue_len} requests; retry shortly")
        tenant = tenant or DEFAULT_TENANT
        # A request that asks for prompt logprobs computes its prompt (the planner matches no
        # cached block for it) but offers its blocks, so its branches take them.
        namespace = self._namespace(adapter, tenant, prefix_group)
        return Request(
            request_id=request_id or f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}",
            tenant=tenant,
            adapter=adapter,
            prompt_ids=ids,
            sampling=sampling,
            arrival_time=self._clock(),
            adapter_tier=self.adapters.residency.tier(adapter) if adapter else "none",
            detokenizer=self._detokenizer(ids, sampling),
            generator=torch.Generator().manual_seed(sampling.seed) if sampling.seed is not None else None,
            logprobs=[] if sampling.logprobs is not None else None,
            prompt_logprobs=[None] if sampling.prompt_logprobs is not None else None,
            cache_namespace=namespace,
            block_keys=block_keys(namespace, ids, self.block_size) if namespace is not None else [],
            stop_ids=(() if sampling.ignore_eos else self._eos) + sampling.stop_token_ids,
            bad_words_ids=bad_words_ids,
            constraint=constraint,
        )

    def _detokenizer(self, prompt_ids: list[int], sampling: SamplingParams) -> Detokenizer:
        if not sampling.detokenize:
            return NoText()
        return IncrementalDecoder(self.tokenizer, prompt_ids, skip_special_tokens=sampling.skip_special_tokens)

    def branch(
        self, first: Request, sampling: SamplingParams, request_id: str, constraint: Constraint | None
    ) -> Request:
        """Another sequence of ``first``'s prompt (``n`` > 1), with its own ``sampling``: the
        prompt's checks, tokens and block keys are ``first``'s, so a branch costs no work that
        grows with the prompt (16,384 branches of 256 prompts once held the loop for seconds)."""
        if request_id in self._in_flight:
            raise InvalidRequestError(f"request_id {request_id!r} is already in flight", param="request_id")
        if self._num_waiting() >= self.max_queue_len:
            raise EngineOverloadedError(f"the queue holds {self.max_queue_len} requests; retry shortly")
        ids = first.prompt_ids
        return Request(
            request_id=request_id,
            tenant=first.tenant,
            adapter=first.adapter,
            prompt_ids=ids,  # never written to: shared
            sampling=sampling,
            arrival_time=self._clock(),
            adapter_tier=first.adapter_tier,
            detokenizer=self._detokenizer(ids, sampling),
            generator=torch.Generator().manual_seed(sampling.seed) if sampling.seed is not None else None,
            logprobs=[] if sampling.logprobs is not None else None,
            prompt_logprobs=None,  # the prompt's are the first's (computed once)
            cache_namespace=first.cache_namespace,
            block_keys=first.block_keys[: len(ids) // self.block_size],  # a copy: the planner extends it
            stop_ids=first.stop_ids,
            bad_words_ids=first.bad_words_ids,
            constraint=constraint,
        )

    def _namespace(self, adapter: str | None, tenant: str, prefix_group: str | None) -> bytes | None:
        """Who may share the request's cached blocks: its tenant, or the tenants of its group
        (a hit is a faster first token, which would tell one tenant what another sent); then the
        base, and for an adapter this registration of it: two adapters, two registrations of one
        name, or an adapter and the base never share a cached block."""
        if self._base_namespace is None:
            return None
        kind, name = (b"group", prefix_group) if prefix_group is not None else (b"tenant", tenant)
        raw = name.encode("utf-8", "surrogatepass")
        # Length-framed, so no tenant or group name can spell another's scope.
        scope = b"|" + kind + struct.pack("<I", len(raw)) + raw
        if adapter is None:
            return self._base_namespace + scope + b"|base"
        return self._base_namespace + scope + b"|adapter|" + self.adapters.get(adapter).cache_id
