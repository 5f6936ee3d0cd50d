"""The step planner: which requests run each step, room for their KV, preemption, and results.

Runs only on the engine's event loop. Everything it works with is handed to it: the scheduling
policy, the adapter cache, the page pool, the engine's limits and a clock. It is also the
:class:`~lorapage.scheduler.base.AdmissionContext` the policy asks while it admits.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from lorapage.adapters.cache import AdapterCache
from lorapage.engine.stops import find_stop, stop_prefix_len
from lorapage.errors import SamplingError
from lorapage.memory.kv import blocks_needed, grow_block_table, held_pages
from lorapage.memory.pool import PagePool
from lorapage.memory.prefix_cache import PrefixCache, block_keys
from lorapage.model.logits_processors import reads_outputs
from lorapage.model.runner import StepPlan, sample_row
from lorapage.model.sampler import SampleOutput
from lorapage.model.windows import blocks_out_of_window
from lorapage.request import Request, RequestStatus, TokenLogprob
from lorapage.scheduler import SchedulerMetrics, SchedulerPolicy
from lorapage.usage import StepRow, UsageLedger


@dataclass(frozen=True)
class StepLimits:
    """The engine's sizes the step planner admits against."""

    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    eos_token_ids: frozenset[int]
    chunked_prefill: bool = True  # a prompt longer than the step's budget is computed over several steps
    # Per layer, its sliding window (None: global); when every layer has one, blocks before the
    # widest window are freed as a sequence moves on. () for models without windows.
    layer_windows: tuple[int | None, ...] = ()
    # Decode steps one plan may run back to back (vLLM's multi-step scheduling): 1, or more while
    # nothing waits and no running row's sampling reads its own outputs (StepPlanner._window).
    num_scheduler_steps: int = 1


class StepPlanner:
    """Requests in flight and the step-by-step transitions between waiting, running and finished."""

    def __init__(
        self,
        policy: SchedulerPolicy[Request],
        adapters: AdapterCache,
        pool: PagePool,
        limits: StepLimits,
        clock: Callable[[], float],
        *,
        metrics: SchedulerMetrics | None = None,
        timer: Callable[[], float] = time.perf_counter,
        prefix_cache: PrefixCache | None = None,
        usage: UsageLedger | None = None,
    ) -> None:
        self.policy, self.adapters, self.pool, self.limits, self.clock = policy, adapters, pool, limits, clock
        self.usage = usage  # cost attribution: every step's rows and the adapters resident
        self.metrics, self._timer = metrics, timer  # the policy's own time per step goes to metrics
        self._policy_s = 0.0  # time spent in the policy for the step being planned and applied
        # Every sequence's blocks go back through it; with caching on it also hands out hits.
        self.prefix = prefix_cache or PrefixCache(pool)
        self.prefix_query_tokens: dict[str, int] = {}  # per tenant: prompt tokens admitted
        self.prefix_hit_tokens: dict[str, int] = {}  # per tenant: of those, found in the cache
        self.requests: dict[str, Request] = {}
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.prompt_tokens_computed = 0  # prompt tokens prefilled (cache hits not counted; recomputes are)
        self._in_step = False  # a plan is on the forward thread: its pages may not be freed yet
        self._budget = 0  # prefill tokens still allowed this step
        self._held: set[str] = set()  # preempted to unblock this very step: not readmitted in it
        self._admitted: list[Request] = []

    # -- arrivals and aborts --------------------------------------------------------------------

    def submit(self, req: Request) -> None:
        self.requests[req.request_id] = req
        if self.metrics is not None:
            self.metrics.record_offered(req.tenant)
        if self.usage is not None:
            self.usage.record_request(req.arrival_time, req.tenant, req.usage_adapter)
        if req.adapter is not None:
            self.adapters.enqueue(req.adapter, req.arrival_time, req.tenant)
        self.policy.add(req, req.arrival_time)

    def abort(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is None or req.status is RequestStatus.FINISHED:
            return
        if req.status is RequestStatus.WAITING:
            self.policy.remove(req)
            self._finish(req, "abort")
        else:
            req.aborted = True  # a step may be reading its pages: freed when the step is applied
            if not self._in_step:
                self._finish(req, "abort")

    def abort_all_after_close(self) -> None:
        """The step loop is gone and the forward thread idle: the results of a step still marked
        in flight will never be applied, so finish every request now."""
        self._in_step = False
        for rid in list(self.requests):
            self.abort(rid)

    # -- AdmissionContext -----------------------------------------------------------------------

    def adapter_ready(self, req: Request) -> bool:
        return req.adapter is None or self.adapters.residency.is_ready(req.adapter)

    def try_admit(self, req: Request) -> bool:
        lim = self.limits
        if len(self.running) + len(self._admitted) >= lim.max_num_seqs or self._budget <= 0:
            return False
        if req.request_id in self._held:
            return False
        hit = self._match_prefix(req)
        remaining = req.num_tokens - req.num_computed
        chunk = min(remaining, self._budget) if lim.chunked_prefill else remaining
        need = blocks_needed(req.num_computed + chunk, lim.block_size) - len(req.block_table)
        # Room beyond what adapter loads already waiting on memory need, or they could starve.
        if (
            chunk > self._budget
            or not self.adapters.room_for_kv(need)
            or not grow_block_table(self.pool, req.block_table, req.num_computed + chunk, lim.block_size)
        ):
            self._free_kv(req)  # the cache hit, if any, goes back
            return False
        self._budget -= chunk
        req.num_scheduled = chunk
        self.prefix.count_uses(req.block_table[: hit // lim.block_size])
        if req.num_preemptions == 0:
            t = req.tenant
            self.prefix_query_tokens[t] = self.prefix_query_tokens.get(t, 0) + req.num_prompt_tokens
            self.prefix_hit_tokens[t] = self.prefix_hit_tokens.get(t, 0) + hit
        self._admitted.append(req)
        if req.adapter is not None:  # it runs on the adapter now, so admitting the next request cannot evict it
            req.lora_slot = self.adapters.admit(req.adapter, self.clock())
        return True

    def _match_prefix(self, req: Request) -> int:
        """Take the cached blocks of ``req``'s longest cached prefix (at least its last token is
        left to compute, for its logits); returns the tokens they hold."""
        if req.cache_namespace is None or req.block_table or req.prompt_logprobs is not None:
            return 0  # prompt logprobs come from computing the prompt: no cached block for it
        bs = self.limits.block_size
        usable = (req.num_tokens - 1) // bs
        self._extend_keys(req, usable * bs)
        # Not counted as a use yet: an admission that fails for room retries every step.
        pages = self.prefix.match(req.block_keys[:usable], count=False)
        req.block_table.extend(pages)
        req.num_computed = len(pages) * bs
        return req.num_computed

    def _extend_keys(self, req: Request, num_tokens: int) -> None:
        """Block keys of ``req``'s first ``num_tokens`` tokens (generated ones included)."""
        assert req.cache_namespace is not None
        have, bs = len(req.block_keys), self.limits.block_size
        if num_tokens // bs > have:
            ids = req.token_range(have * bs, num_tokens // bs * bs)
            parent = req.block_keys[-1] if have else b""
            req.block_keys += block_keys(req.cache_namespace, ids, bs, parent=parent)

    def _offer_blocks(self, req: Request, computed_before: int) -> None:
        """Blocks ``req`` filled this step join the cache, for later requests with that prefix."""
        if req.cache_namespace is None:
            return
        bs = self.limits.block_size
        first, last = computed_before // bs, req.num_computed // bs
        if last > first:
            self._extend_keys(req, last * bs)
            for b in range(first, last):
                self.prefix.offer(req.block_keys[b], req.block_table[b])

    # -- one step -------------------------------------------------------------------------------

    def plan_step(self) -> StepPlan | None:
        """Admit, make room for decodes, and return the step's plan (None: nothing can run).

        The step's token budget goes to decodes first (one token each), then to prompts already
        being prefilled in chunks (oldest first), then to new admissions."""
        now = self.clock()
        self._fail_broken_adapters()
        for req in self.policy.reclaim(now):  # a lent lane owed back past its bound
            if req.status is RequestStatus.RUNNING and req in self.running:
                self._preempt(req, now)
        for req in self.running:
            self._free_out_of_window(req)
        decode = [r for r in self.running if r.num_computed == r.num_tokens - 1]
        self._make_room(decode, now)
        decode = [r for r in self.running if r.num_computed == r.num_tokens - 1]
        self._budget = self.limits.max_num_batched_tokens - len(decode)
        chunks, stalled = self._continue_prefills()
        self._admitted = []
        started = self._timer()
        try:
            admitted = self.policy.schedule(now, self)
        except BaseException:
            self._undo_admissions()  # still WAITING to everyone else: none may stay admitted on its adapter
            raise
        finally:
            self._policy_s = self._timer() - started
        prefill = chunks
        for req in admitted:
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            prefill.append((req, req.num_scheduled))
        if not decode and not prefill:
            if stalled:  # partial prefills that cannot grow and nothing else running: make room
                victim = self.policy.pick_victim(stalled)
                self._preempt(victim, now)
                # Held out of this step's admissions: readmitted at once, it would take the same
                # pages back and stall again, while the queued requests that could free them wait.
                self._held.add(victim.request_id)
                try:
                    return self.plan_step()
                finally:
                    self._held.discard(victim.request_id)
            return None
        self._in_step = True
        steps = self._window(decode) if not prefill else 1
        return StepPlan.build(decode, prefill, self.limits.block_size, steps)

    def _window(self, decode: list[Request]) -> int:
        """How many decode steps a decode-only plan runs back to back (``num_scheduler_steps``): one
        while a request waits (it is admitted at the next plan) or a row's sampling reads its own
        outputs; else as many as every row has tokens left to generate (within ``max_tokens`` and
        the context) and pages for. A row that stops early (EOS) has its later tokens discarded."""
        steps = self.limits.num_scheduler_steps
        if steps == 1 or len(self.requests) > len(self.running):
            return 1
        for r in decode:
            if reads_outputs(sample_row(r)):
                return 1
            steps = min(steps, r.sampling.max_tokens - len(r.output_ids), self.limits.max_model_len - r.num_tokens)
        if steps <= 1:
            return 1
        # Pages for every fed position (grown tables stay grown: the next plans use them).
        bs = self.limits.block_size
        if not all(grow_block_table(self.pool, r.block_table, r.num_tokens + steps - 1, bs) for r in decode):
            return 1
        return steps

    def apply_window(self, plan: StepPlan, outs: list[SampleOutput], step_s: float = 0.0) -> None:
        """:meth:`apply` for each of a window's steps in turn (``plan.steps`` of them), the rows still
        running at each: a row finished earlier in the window (EOS, a stop string, aborted, failed)
        has its later tokens discarded."""
        for j, out in enumerate(outs):
            step = plan
            if j:
                keep = [i for i, r in enumerate(plan.sequences) if r.status is RequestStatus.RUNNING]
                step, out = plan.rows(keep), out.rows(keep)
            self.apply(step, out, step_s / len(outs))

    def _continue_prefills(self) -> tuple[list[tuple[Request, int]], list[Request]]:
        """The next chunk of each running prompt not fully computed yet, as far as the budget
        and free pages go; also those that could not get pages for one."""
        bs = self.limits.block_size
        chunks: list[tuple[Request, int]] = []
        stalled: list[Request] = []
        partial = [r for r in self.running if r.num_computed < r.num_tokens - 1]
        for req in sorted(partial, key=lambda r: r.arrival_time):
            chunk = min(req.num_tokens - req.num_computed, self._budget)
            if chunk <= 0:
                break
            need = blocks_needed(req.num_computed + chunk, bs) - len(req.block_table)
            self.adapters.room_for_kv(need, reserve=False)
            # As much of the chunk as the pages that can be had now hold: a long prompt moves on
            # with what frees, instead of waiting for its whole chunk while others take each page.
            chunk = min(chunk, (len(req.block_table) + self.pool.num_free) * bs - req.num_computed)
            if chunk <= 0 or not grow_block_table(self.pool, req.block_table, req.num_computed + chunk, bs):
                stalled.append(req)
                continue
            self._budget -= chunk
            chunks.append((req, chunk))
        return chunks, stalled

    def _undo_admissions(self) -> None:
        """The policy failed mid-schedule: give back what this step's admissions took."""
        for req in self._admitted:
            self._unadmit(req)
        self._admitted = []

    def _unadmit(self, req: Request) -> None:
        """Give back what admission took: KV pages (its KV must be recomputed), and its hold on
        the adapter (the request counts as queued for its adapter again). Nothing is owed for an
        admission :meth:`~lorapage.adapters.residency.Residency.admit` refused."""
        self._free_kv(req)
        if req.lora_slot and req.adapter is not None:
            self.adapters.requeue(req.adapter)
        req.lora_slot = 0

    def _free_kv(self, req: Request) -> None:
        """Give ``req``'s KV pages back (cached blocks stay cached, idle once nobody holds them):
        none of its tokens is computed any more."""
        self.prefix.release(req.block_table)
        req.num_computed = 0

    def _free_out_of_window(self, req: Request) -> None:
        """Give back the blocks no layer's window reads again (all layers windowed only): their
        table entries become page 0, which the attention kernels never read, so positions keep
        their blocks' indices. Cached ones stay cached (idle once nobody holds them)."""
        gone = blocks_out_of_window(self.limits.layer_windows, req.num_computed, self.limits.block_size)
        first = next((i for i, page in enumerate(req.block_table[:gone]) if page), gone)
        if first < gone:
            self.prefix.release(req.block_table[first:gone], first_depth=first)
            req.block_table[first:gone] = [0] * (gone - first)

    def _make_room(self, decode: list[Request], now: float) -> None:
        """Each decode needs a page for its next token: evict idle adapters, then preempt."""
        bs = self.limits.block_size
        for req in sorted(decode, key=lambda r: r.arrival_time):
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted below for an older request
            while not grow_block_table(self.pool, req.block_table, req.num_tokens, bs):
                if self.adapters.room_for_kv(1, reserve=False):
                    continue
                victim = self.policy.pick_victim([r for r in self.running if r.status is RequestStatus.RUNNING])
                self._preempt(victim, now)
                if victim is req:
                    break

    def _preempt(self, req: Request, now: float) -> None:
        """Free ``req``'s pages and queue it again; it recomputes its KV when readmitted."""
        self._unadmit(req)
        self.running.remove(req)
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.policy.preempt(req, now)  # it waits again; VTC does not charge its recompute
        self.adapters.memory_freed()

    def apply(self, plan: StepPlan, sampled: SampleOutput, step_s: float = 0.0) -> None:
        """Record each sequence's computed tokens and new token, charge the policy, stream
        outputs, finish what is done. A row that could not be sampled fails its own request alone."""
        self._in_step = False
        now = self.clock()
        samples = iter(zip(sampled.tokens, sampled.logprobs, sampled.errors))
        for i, first, logprobs in sampled.prompt_logprobs:
            req = plan.sequences[i]
            if req.prompt_logprobs is not None and len(req.prompt_logprobs) == first:  # not a recompute
                req.prompt_logprobs.extend(logprobs)
        rows = [
            (req, fed, next(samples) if completes else None)
            for req, fed, completes in zip(plan.sequences, plan.fed, plan.completes)
        ]
        for req, fed, _ in rows:
            req.num_computed += fed
            req.prompt_computed = max(req.prompt_computed, min(req.num_computed, req.num_prompt_tokens))
            if not req.aborted:
                self._offer_blocks(req, req.num_computed - fed)
        started = self._timer()
        charged = []
        for i, (req, fed, sample) in enumerate(rows):
            # A decode row whose token is still the prompt's last (a chunk stopped one short) is input.
            prompt_fed = fed if i >= plan.num_decode or req.num_computed <= req.num_prompt_tokens else 0
            sampled_one = int(sample is not None)
            # Only a model whose every layer is windowed frees blocks (page 0): count them then alone.
            pages = held_pages(req.block_table) if self.limits.layer_windows else len(req.block_table)
            charged.append(StepRow(req.tenant, req.usage_adapter, prompt_fed, sampled_one, pages))
            if req.aborted:
                continue
            # Charged before a failure too: a request that cannot be sampled still took the step.
            self.prompt_tokens_computed += prompt_fed
            self.policy.on_service(req, prompt_fed, sampled_one, now)
        self._policy_s += self._timer() - started
        if self.usage is not None:
            self.usage.record_step(now, step_s, charged)
            self.usage.record_residency(now, self.adapters.residency.slots.resident_pages())
        for req, _, sample in rows:
            if req.aborted:
                self._finish(req, "abort")
            elif sample is None:
                continue  # a chunk of a longer prompt: more of it next step
            elif sample[2] is not None:
                self._fail(req, SamplingError(f"request {req.request_id!r} could not be sampled: {sample[2]}"))
            else:
                self._append(req, sample[0], sample[1], now)
        # Aborted while this step ran, but not in it (a prompt chunk left out for budget or pages):
        # nothing reads its pages now, so it ends here rather than whenever it next runs.
        for req in [r for r in self.running if r.aborted]:
            self._finish(req, "abort")
        if self.metrics is not None:
            self.metrics.record_policy_time(self._policy_s)

    def _append(self, req: Request, token: int, lp: TokenLogprob | None, now: float) -> None:
        p = req.sampling
        req.output_ids.append(token)
        if lp is not None and req.logprobs is not None:
            req.logprobs.append(lp)
        if req.first_token_time is None:
            req.first_token_time = now
        reason = None
        is_stop_token = (token in self.limits.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids
        if req.constraint is not None:
            req.constraint.consume(token)
            if (problem := req.constraint.error) is not None:
                self._fail(req, SamplingError(f"request {req.request_id!r} left its output constraint: {problem}"))
                return
            # A complete grammar ends the output (its EOS, or no possible continuation).
            is_stop_token = is_stop_token or (req.constraint.done and token in self.limits.eos_token_ids)
        if not is_stop_token:
            req.text += req.detokenizer.push(token)
        else:
            reason = "stop"
        if reason is None and req.constraint is not None and req.constraint.done:
            reason = "stop"
        cut = find_stop(req.text, p.stop, req.sent_len)
        if cut is not None:
            req.text = req.text[: cut[1] if p.include_stop_str_in_output else cut[0]]
            reason = "stop"
        if reason is None and (len(req.output_ids) >= p.max_tokens or req.num_tokens >= self.limits.max_model_len):
            reason = "length"
        if reason is not None and cut is None:
            req.text += req.detokenizer.flush()  # bytes of an unfinished character, if any
        if reason is not None:
            self._finish(req, reason)
        else:
            self._emit(req)

    def _emit(self, req: Request, finish_reason: str | None = None) -> None:
        finished = finish_reason is not None
        # Hold back text that may be the start of a stop string until it is resolved.
        visible = len(req.text) if finished else len(req.text) - stop_prefix_len(req.text, req.sampling.stop)
        req.sent_len = max(req.sent_len, visible)
        req.outputs.publish(req.sent_len, finish_reason)

    def _finish(self, req: Request, reason: str, emit: bool = True) -> None:
        was_running = req.status is RequestStatus.RUNNING
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        if was_running:
            self.running.remove(req)
            self._free_kv(req)
            self.adapters.finish(req.adapter)
        elif req.adapter is not None:
            self.adapters.dequeue(req.adapter)
        self.policy.on_finish(req, self.clock())
        self.requests.pop(req.request_id, None)
        if emit:
            self._emit(req, reason)

    def fail_all(self, error: BaseException) -> None:
        """A step failed unexpectedly: every request in flight gets the error and its pages back,
        and the engine carries on with new requests."""
        self._in_step = False
        for req in list(self.requests.values()):
            self._fail(req, error)

    def _fail(self, req: Request, error: BaseException) -> None:
        """End ``req`` with ``error`` instead of an output."""
        if req.status is RequestStatus.WAITING:
            self.policy.remove(req)
        self._finish(req, "abort", emit=False)
        req.outputs.fail(error)

    def _fail_broken_adapters(self) -> None:
        """Waiting requests whose adapter failed to load get that error; nothing else is touched."""
        failed = self.adapters.take_failed()
        if not failed:
            return
        for req in list(self.requests.values()):
            if req.status is RequestStatus.WAITING and req.adapter in failed:
                self.policy.remove(req)
                req.status = RequestStatus.FINISHED
                self.adapters.dequeue(req.adapter)
                self.requests.pop(req.request_id, None)
                req.outputs.fail(failed[req.adapter])
