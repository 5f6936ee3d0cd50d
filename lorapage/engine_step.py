"""The engine's per-step bookkeeping: admission, room for decodes, preemption, applying results.

Runs only on the engine's event loop. Also the :class:`~lorapage.scheduler.base.AdmissionContext`
the scheduling policy asks while it admits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lorapage.memory.kv import blocks_needed, free_block_table, grow_block_table
from lorapage.model.runner import StepPlan
from lorapage.model.sampler import TokenLogprob
from lorapage.request import Request, RequestOutput, RequestStatus

if TYPE_CHECKING:
    from lorapage.engine import Engine


class StepState:
    """Requests in flight and the step-by-step transitions between waiting, running and finished."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.requests: dict[str, Request] = {}
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._in_step = False
        self._budget = 0  # prefill tokens still allowed this step
        self._admitted: list[Request] = []

    # -- arrivals and aborts --------------------------------------------------------------------

    def submit(self, req: Request) -> None:
        e = self.engine
        self.requests[req.request_id] = req
        if req.adapter is not None:
            entry = e.adapters.get(req.adapter)
            entry.waiting += 1
            entry.touch(req.arrival_time)
            e.adapters.ensure(req.adapter)  # the fetch overlaps queueing
        e.policy.add(req, req.arrival_time)

    def abort(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is None or req.status is RequestStatus.FINISHED:
            return
        if req.status is RequestStatus.WAITING:
            self.engine.policy.remove(req)
            self._finish(req, "abort")
        else:
            req.aborted = True  # a step may be reading its pages: freed when the step is applied
            if not self._in_step:
                self._finish(req, "abort")

    # -- AdmissionContext -----------------------------------------------------------------------

    def adapter_ready(self, req: Request) -> bool:
        return req.adapter is None or self.engine.adapters.is_ready(req.adapter)

    def running_adapters(self) -> set[str | None]:
        return {r.adapter for r in self.running}

    def try_admit(self, req: Request) -> bool:
        e = self.engine
        new_tokens = req.num_tokens
        if len(self.running) + len(self._admitted) >= e.config.max_num_seqs or new_tokens > self._budget:
            return False
        need = blocks_needed(new_tokens, e.config.block_size)
        # Leave room for adapter loads already waiting on memory, or they could starve.
        reserve = e.adapters.pending_pages()
        own = e.adapters.get(req.adapter) if req.adapter is not None else None
        if e.pool.num_free - reserve < need and not e.adapters.evict_idle(need + reserve):
            return False
        if not grow_block_table(e.pool, req, new_tokens, e.config.block_size):
            return False
        self._budget -= new_tokens
        self._admitted.append(req)
        if own is not None:  # pin now, so admitting the next request cannot evict it
            req.lora_slot = e.adapters.acquire(req.adapter)
            own.waiting -= 1
        return True

    # -- one step -------------------------------------------------------------------------------

    def plan_step(self) -> StepPlan | None:
        """Admit, make room for decodes, and return the step's plan (None: nothing can run)."""
        e = self.engine
        now = e.clock()
        self._fail_broken_adapters()
        decode = [r for r in self.running if r.num_computed == r.num_tokens - 1]
        self._make_room(decode, now)
        decode = [r for r in self.running if r.num_computed == r.num_tokens - 1]
        self._budget = e.max_num_batched_tokens - len(decode)
        self._admitted = []
        try:
            admitted = e.policy.schedule(now, self)
        except BaseException:
            self._undo_admissions()  # still WAITING to everyone else: nothing may stay pinned
            raise
        prefill = []
        for req in admitted:
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            prefill.append(req)
        if not decode and not prefill:
            return None
        self._in_step = True
        return StepPlan.build(decode, prefill, e.config.block_size)

    def _undo_admissions(self) -> None:
        """The policy failed mid-schedule: give back what this step's admissions took."""
        for req in self._admitted:
            self._unadmit(req)
        self._admitted = []

    def _unadmit(self, req: Request) -> None:
        """Give back what admission took: KV pages, and the adapter pin (the request counts as
        queued for its adapter again). Nothing is owed for a pin that acquire() refused."""
        e = self.engine
        free_block_table(e.pool, req)
        if req.lora_slot:
            e.adapters.release(req.adapter)
            e.adapters.get(req.adapter).waiting += 1
        req.lora_slot = 0

    def _make_room(self, decode: list[Request], now: float) -> None:
        """Each decode needs a page for its next token: evict idle adapters, then preempt."""
        e = self.engine
        bs = e.config.block_size
        for req in sorted(decode, key=lambda r: r.arrival_time):
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted below for an older request
            while not grow_block_table(e.pool, req, req.num_tokens, bs):
                if e.adapters.evict_idle(1):
                    continue
                victim = e.policy.pick_victim([r for r in self.running if r.status is RequestStatus.RUNNING])
                self._preempt(victim, now)
                if victim is req:
                    break

    def _preempt(self, req: Request, now: float) -> None:
        """Free ``req``'s pages and queue it again; it recomputes its KV when readmitted."""
        e = self.engine
        self._unadmit(req)
        self.running.remove(req)
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        e.policy.add(req, now)  # VTC knows a returning request: the recompute is not charged again
        e.adapters.notify_memory_freed()

    def apply(self, plan: StepPlan, tokens: list[int], logprobs: list[TokenLogprob | None]) -> None:
        """Record each sequence's new token, stream outputs, finish what is done."""
        e = self.engine
        self._in_step = False
        now = e.clock()
        for i, (req, token, lp) in enumerate(zip(plan.sequences, tokens, logprobs)):
            fed = req.num_tokens - req.num_computed
            req.num_computed = req.num_tokens
            if req.aborted:
                self._finish(req, "abort")
                continue
            e.policy.on_service(req, fed if i >= plan.num_decode else 0, 1, now)
            self._append(req, token, lp, now)

    def _append(self, req: Request, token: int, lp: TokenLogprob | None, now: float) -> None:
        e = self.engine
        p = req.sampling
        req.output_ids.append(token)
        if lp is not None:
            req.logprobs.append(lp)
        if req.first_token_time is None:
            req.first_token_time = now
        reason = None
        is_stop_token = (token in e.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids
        if not is_stop_token:
            req.text += req.detokenizer.push(token)
        else:
            reason = "stop"
        cut = _find_stop(req.text, p.stop, req.sent_len)
        if cut is not None:
            req.text = req.text[: cut[1] if p.include_stop_str_in_output else cut[0]]
            reason = "stop"
        if reason is None and (len(req.output_ids) >= p.max_tokens or req.num_tokens >= e.max_model_len):
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
        visible = len(req.text) if finished else len(req.text) - _stop_prefix_len(req.text, req.sampling.stop)
        sent = req.sent_len
        delta = req.text[sent:visible] if visible > sent else ""
        req.sent_len = max(sent, visible)
        req.outputs.put_nowait(
            RequestOutput(
                request_id=req.request_id,
                prompt_token_ids=req.prompt_ids,
                token_ids=list(req.output_ids),
                text=req.text[: req.sent_len],
                delta_text=delta,
                logprobs=list(req.logprobs) if req.logprobs is not None else None,
                finished=finished,
                finish_reason=finish_reason,
                adapter_tier=req.adapter_tier,
            )
        )

    def _finish(self, req: Request, reason: str, emit: bool = True) -> None:
        e = self.engine
        was_running = req.status is RequestStatus.RUNNING
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        if was_running:
            self.running.remove(req)
            free_block_table(e.pool, req)
            if req.adapter is not None:
                e.adapters.release(req.adapter)
            e.adapters.notify_memory_freed()
        elif req.adapter is not None:
            e.adapters.get(req.adapter).waiting -= 1
            e.adapters.notify_memory_freed()  # the adapter may now be evictable for a waiting load
        e.policy.on_finish(req, e.clock())
        self.requests.pop(req.request_id, None)
        if emit:
            self._emit(req, reason)

    def fail_all(self, error: BaseException) -> None:
        """A step failed unexpectedly: every request in flight gets the error and its pages back,
        and the engine carries on with new requests."""
        e = self.engine
        self._in_step = False
        for req in list(self.requests.values()):
            if req.status is RequestStatus.WAITING:
                e.policy.remove(req)
            self._finish(req, "abort", emit=False)
            req.outputs.put_nowait(error)

    def _fail_broken_adapters(self) -> None:
        """Waiting requests whose adapter failed to load get that error; nothing else is touched."""
        e = self.engine
        failed = e.adapters.take_failed()
        if not failed:
            return
        for req in list(self.requests.values()):
            if req.status is RequestStatus.WAITING and req.adapter in failed:
                e.policy.remove(req)
                req.status = RequestStatus.FINISHED
                e.adapters.get(req.adapter).waiting -= 1
                self.requests.pop(req.request_id, None)
                req.outputs.put_nowait(failed[req.adapter])


def _find_stop(text: str, stops: tuple[str, ...], start: int) -> tuple[int, int] | None:
    """(start, end) of the earliest stop string in ``text`` at or after ``start``."""
    best = None
    for s in stops:
        i = text.find(s, max(0, start - len(s)))
        if i != -1 and (best is None or i < best[0]):
            best = (i, i + len(s))
    return best


def _stop_prefix_len(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best
