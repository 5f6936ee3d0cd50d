"""A request's answer built from its engine outputs: chat and completion bodies whole or as
stream chunks, with their logprobs, tool calls and echoed prompts."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, cast

import msgspec

from lorapage.errors import ServiceUnavailableError
from lorapage.frontend import responses as r
from lorapage.frontend.job import Job
from lorapage.tools.formats import ToolCall
from lorapage.tools.reasoning import ReasoningStream, split_reasoning
from lorapage.tools.stream import ToolStream


def _finish_reason(out: Any, calls: bool = False) -> str:
    """OpenAI's finish_reason: ``length`` for an output max_tokens cut, even beside tool calls
    it finished (a call it was writing is dropped); ``tool_calls`` for one that ended in calls."""
    if out.finish_reason == "abort":
        raise ServiceUnavailableError("the request was aborted: the server is shutting down; retry elsewhere")
    if out.finish_reason == "length":
        return "length"
    if calls:
        return "tool_calls"
    return out.finish_reason or "stop"


# An answer with more logprob entries, or more choices, is built and encoded off the event loop.
INLINE_LOGPROB_ENTRIES = 4096
INLINE_CHOICES = 256
# Runs fn(outs) on a worker and awaits it (the server's prompt workers, in the tenant's turn).
Offload = Callable[[Callable[[list[Any]], bytes], list[Any]], Awaitable[bytes]]


@dataclass
class _Choice:
    """One choice's formatting state."""

    logprobs_sent: int = 0
    text_offset: int = 0
    gathered: r.ChatLogprobs | r.CompletionLogprobs | None = None
    tools: ToolStream | None = None
    reasoning: ReasoningStream | None = None
    last: Any = None
    role_sent: bool = False


class Formatter:
    """Builds one request's chat or completion bodies, including logprobs, tool calls and echoed
    prompts, from engine outputs, choice by choice.

    A whole answer's logprobs are formatted as its outputs arrive (:meth:`gather`), a step's
    tokens at a time, not all at the end: 16,000 tokens with 20 alternatives each once held the
    event loop for 1.7 s after the last one."""

    def __init__(self, job: Job, tokenizer: Any, offload: Offload | None = None) -> None:
        self.job, self.tokenizer, self.offload = job, tokenizer, offload
        self._choices: dict[int, _Choice] = {}
        self._tokens: dict[int, tuple[str, list[int]]] = {}  # token id -> its text and bytes (at most the vocabulary)
        # Per prompt, formatted once for all its choices: vLLM's prompt_logprobs, and an echo's
        # prompt logprobs with the length of the prompt's text.
        self._prompt_rows: dict[int, r.PromptLogprobs | None] = {}
        self._echoed: dict[int, tuple[r.CompletionLogprobs, int] | None] = {}

    def choice(self, index: int) -> _Choice:
        c = self._choices.get(index)
        if c is None:
            c = self._choices[index] = _Choice()
            if self.job.tools is not None:
                c.tools = ToolStream(self.job.tools.fmt, self.job.tools.tools)
            if self.job.thinking_open is not None:
                c.reasoning = ReasoningStream(self.job.thinking_open)
        return c

    def _token(self, token_id: int) -> tuple[str, list[int]]:
        got = self._tokens.get(token_id)
        if got is None:
            text = self.tokenizer.backend.decode([token_id])
            got = self._tokens[token_id] = (text, list(text.encode()))
        return got

    def _chat_logprobs(self, items: list) -> r.ChatLogprobs:
        content = []
        for lp in items:
            tok, tok_bytes = self._token(lp.token_id)
            top = [r.TopLogprob(t, v, b) for (t, b), v in ((self._token(i), v) for i, v in lp.top)]
            content.append(r.ChatTokenLogprob(tok, lp.logprob, tok_bytes, top))
        return r.ChatLogprobs(content=content)

    def _completion_logprobs(self, items: list, c: _Choice) -> r.CompletionLogprobs:
        out = r.CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        for lp, token_id in items:
            tok = self._token(token_id)[0]
            out.tokens.append(tok)
            out.token_logprobs.append(lp.logprob if lp is not None else None)
            out.top_logprobs.append({self._token(i)[0]: v for i, v in lp.top} if lp is not None else None)
            out.text_offset.append(c.text_offset)
            c.text_offset += len(tok)
        return out

    def _new_logprobs(self, out: Any) -> Any:
        """Logprobs of the tokens of choice ``out.index`` not reported yet (``None``: none new)."""
        c = self.choice(out.index)
        items = (out.logprobs or [])[c.logprobs_sent :]
        if self.job.echo_only:
            items = []
        if not items:
            return None
        c.logprobs_sent += len(items)
        if self.job.kind == "chat":
            return self._chat_logprobs(items)
        return self._completion_logprobs([(lp, lp.token_id) for lp in items], c)

    def _echoed_logprobs(self, out: Any) -> tuple[r.CompletionLogprobs, int] | None:
        """An echoed prompt's tokens as the start of its choices' logprobs (the first: None), and
        the length of their text; formatted once per prompt."""
        if self.job.sampling.logprobs is None:
            return None
        prompt = out.index // self.job.sampling.n
        if prompt not in self._echoed:
            entries = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
            counter = _Choice()
            formatted = self._completion_logprobs(list(zip(entries, out.prompt_token_ids)), counter)
            self._echoed[prompt] = (formatted, counter.text_offset)
        return self._echoed[prompt]

    def gather(self, out: Any) -> None:
        """Format the logprobs ``out`` adds to its choice, for :meth:`whole` (an echoed prompt's
        are formatted there, off the event loop when large)."""
        c = self.choice(out.index)
        c.last = out
        new = self._new_logprobs(out)
        if new is None:
            return
        if c.gathered is None:
            c.gathered = new
        elif isinstance(c.gathered, r.ChatLogprobs):
            assert isinstance(new, r.ChatLogprobs)
            c.gathered.content.extend(new.content)
        else:
            assert isinstance(new, r.CompletionLogprobs)
            for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                getattr(c.gathered, name).extend(getattr(new, name))

    def _with_echo(self, out: Any, generated: r.CompletionLogprobs | None) -> r.CompletionLogprobs | None:
        """A completion choice's logprobs: its echoed prompt's, then its generated tokens'."""
        echoed = self._echoed_logprobs(out) if self.job.echo else None
        if echoed is None:
            return generated
        prompt, length = echoed
        if generated is None:
            return prompt
        return r.CompletionLogprobs(
            tokens=prompt.tokens + generated.tokens,
            token_logprobs=prompt.token_logprobs + generated.token_logprobs,
            top_logprobs=prompt.top_logprobs + generated.top_logprobs,
            text_offset=prompt.text_offset + [length + o for o in generated.text_offset],
        )

    def _prompt_logprobs(self, out: Any) -> r.PromptLogprobs | None:
        """vLLM's ``prompt_logprobs`` of a choice's prompt, when asked for (formatted once per prompt)."""
        if self.job.sampling.prompt_logprobs is None or out.prompt_logprobs is None:
            return None
        prompt = out.index // self.job.sampling.n
        if prompt in self._prompt_rows:
            return self._prompt_rows[prompt]
        result: r.PromptLogprobs = []
        for lp in out.prompt_logprobs:
            if lp is None:
                result.append(None)
                continue
            # The alternatives come most likely first: their ranks are 1..k (as vLLM gives them).
            entry = {i: r.PromptLogprob(v, k, self._token(i)[0]) for k, (i, v) in enumerate(lp.top, 1)}
            entry[lp.token_id] = r.PromptLogprob(lp.logprob, lp.rank, self._token(lp.token_id)[0])
            result.append(entry)
        self._prompt_rows[prompt] = result
        return result

    def _text(self, out: Any) -> str:
        text = "" if self.job.echo_only else out.text
        if self.job.echo:
            text = self.job.prompt_texts[out.index // self.job.sampling.n] + text
        return text

    def whole(self, outs: list[Any]) -> r.ChatCompletion | r.Completion:
        """The whole answer from each choice's last output (in choice order)."""
        j = self.job
        usage = _usage(j, outs)
        if j.kind == "chat":
            choices = []
            for out in outs:
                c = self.choice(out.index)
                calls: list[ToolCall] = []
                reasoning, content = None, out.text
                if j.thinking_open is not None:
                    reasoning, content = split_reasoning(out.text, j.thinking_open)
                if j.tools is not None:
                    content, calls = j.tools.fmt.parse(content, out.finish_reason == "length", j.tools.tools)
                message = _message(content, calls, reasoning, j.thinking_open is not None)
                assert c.gathered is None or isinstance(c.gathered, r.ChatLogprobs)
                choices.append(r.ChatChoice(message, _finish_reason(out, bool(calls)), c.gathered, out.index))
            return r.ChatCompletion(
                id=j.request_id,
                created=j.created,
                model=j.model,
                choices=choices,
                usage=usage,
                prompt_logprobs=self._prompt_logprobs(outs[0]),
            )
        completion_choices = []
        for out in outs:
            c = self.choice(out.index)
            assert c.gathered is None or isinstance(c.gathered, r.CompletionLogprobs)
            reason = "length" if j.echo_only else _finish_reason(out)
            logprobs = self._with_echo(out, c.gathered)
            completion_choices.append(
                r.CompletionChoice(self._text(out), reason, logprobs, out.index, self._prompt_logprobs(out))
            )
        return r.Completion(id=j.request_id, created=j.created, model=j.model, choices=completion_choices, usage=usage)

    def encode(self, outs: list[Any]) -> bytes:
        """:meth:`whole` as JSON, encoded in pieces (a choice, or 512 prompt rows, at a time):
        one encoder call holds the GIL throughout, and a 17 MB answer in one call once held the
        event loop for 90 ms from a worker thread. Each prompt's rows are encoded once for all
        its choices."""
        whole = self.whole(outs)
        encoded: dict[int, msgspec.Raw] = {}  # id of a prompt's rows -> their JSON

        def rows(found: r.PromptLogprobs | None) -> Any:
            if found is None:
                return None
            if id(found) not in encoded:
                encoded[id(found)] = msgspec.Raw(_encode_list(found, 512))
            return encoded[id(found)]

        if isinstance(whole, r.ChatCompletion):
            whole.prompt_logprobs = rows(whole.prompt_logprobs)
        else:
            for choice in whole.choices:
                choice.prompt_logprobs = rows(choice.prompt_logprobs)
        whole.choices = cast(Any, msgspec.Raw(_encode_list(whole.choices, 1)))
        body = msgspec.json.encode(whole)
        # Freed here, where it was built: a quarter of a million formatted rows freed on the event
        # loop once held it for 60 ms.
        self._prompt_rows.clear()
        self._echoed.clear()
        self._choices.clear()
        encoded.clear()
        del whole
        return body

    async def body(self, outs: list[Any]) -> bytes:
        """:meth:`encode`, on a worker in its tenant's turn (``offload``) when the answer's
        logprobs are many: prompt logprobs (bounded by the job) are formatted only here."""
        small = self.job.logprob_entries() <= INLINE_LOGPROB_ENTRIES and len(outs) <= INLINE_CHOICES
        if self.offload is None or small:
            return self.encode(outs)
        return await self.offload(self.encode, outs)

    def chunk(
        self,
        index: int,
        text: str | None,
        logprobs: Any = None,
        finish: str | None = None,
        *,
        role: bool = False,
        calls: list[ToolCall] | None = None,
        reasoning: str | None = None,
    ):
        j = self.job
        if j.kind == "chat":
            deltas = [
                r.ToolCallDelta(k, t.id, r.FunctionCallOut(t.name, t.arguments)) for k, t in enumerate(calls or [])
            ]
            delta = r.ChatDelta(
                role="assistant" if role else None, content=text, reasoning_content=reasoning, tool_calls=deltas or None
            )
            chat = r.ChatChunkChoice(delta=delta, finish_reason=finish, logprobs=logprobs, index=index)
            return r.ChatCompletionChunk(id=j.request_id, created=j.created, model=j.model, choices=[chat])
        choice = r.CompletionChoice(text=text or "", finish_reason=finish, logprobs=logprobs, index=index)
        return r.Completion(id=j.request_id, created=j.created, model=j.model, choices=[choice])

    def deltas(self, out: Any) -> list:
        """The chunks carrying what ``out`` adds to its choice (the role first, in a chat), and,
        when it is the choice's last output, its tool calls and finish."""
        c, j = self.choice(out.index), self.job
        chunks = []
        if j.kind == "chat" and not c.role_sent:
            c.role_sent = True
            chunks.append(self.chunk(out.index, "", role=True))
        text = out.delta_text
        if c.reasoning is not None:
            thought, text = c.reasoning.feed(text)
            if out.finished:
                more, rest = c.reasoning.finish()
                thought, text = thought + more, text + rest
            if thought:
                chunks.append(self.chunk(out.index, None, reasoning=thought))
        if c.tools is not None:
            text = c.tools.feed(text)
        logprobs = self._new_logprobs(out)
        if text or logprobs is not None:
            chunks.append(self.chunk(out.index, text, logprobs))
        if out.finished:
            calls: list[ToolCall] = []
            if c.tools is not None:
                rest, calls = c.tools.finish(out.finish_reason == "length")
                if rest:
                    chunks.append(self.chunk(out.index, rest))
                if calls:
                    chunks.append(self.chunk(out.index, None, calls=calls))
            finish = _finish_reason(out, bool(calls))
            chunks.append(self.chunk(out.index, None if j.kind == "chat" else "", finish=finish))
        return chunks

    def usage(self, outs: list[Any]):
        j = self.job
        kind = r.ChatCompletionChunk if j.kind == "chat" else r.Completion
        return kind(id=j.request_id, created=j.created, model=j.model, choices=[], usage=_usage(j, outs))


def _message(content: str, calls: list[ToolCall], reasoning: str | None, parsed: bool) -> r.AssistantMessage:
    """A chat choice's message: no content beside calls unless there is some; under a reasoning
    parser, the reasoning (and no empty content beside it, as vLLM answers)."""
    tool_calls = [r.ToolCallOut(t.id, r.FunctionCallOut(t.name, t.arguments)) for t in calls] or None
    if not parsed:
        return r.AssistantMessage(content=content if content or not calls else None, tool_calls=tool_calls)
    shown = content if content or (not calls and reasoning is None) else None
    return r.ReasoningMessage(content=shown, tool_calls=tool_calls, reasoning_content=reasoning)


def _encode_list(items: list[Any], per: int) -> bytes:
    """``items`` as one JSON array, encoded ``per`` items at a time."""
    pieces = (msgspec.json.encode(items[i : i + per])[1:-1] for i in range(0, len(items), per))
    return b"[" + b",".join(pieces) + b"]"


def _usage(job: Job, outs: list[Any]) -> r.Usage:
    """Each prompt counts once, whatever its ``n``; every choice's tokens count."""
    p = job.prompt_tokens
    c = 0 if job.echo_only else sum(len(o.token_ids) for o in outs)
    return r.Usage(prompt_tokens=p, completion_tokens=c, total_tokens=p + c, adapter_version=job.adapter_version)
