"""Compiling structured-output specs with llguidance, off the event loop, bounded and cached.

llguidance was chosen over xgrammar (both measured in ``bench/bench_grammar.py``; docs/api.md
has the figures): it computes each step's mask lazily from an Earley parser over a lexer, so a
grammar costs nothing to "compile" ahead of time and a hostile schema cannot make a minutes-long
precompile; its work per step is bounded by :class:`llguidance.LLParserLimits` (lexer fuel,
parser items), which is what bounds a hostile grammar; it reads the model's ``tokenizer.json``
as is; and it installs as one dependency-free wheel (xgrammar needs transformers and triton).

A spec is turned into llguidance's grammar text and validated once (cached by spec, LRU); each
request then gets its own :class:`Constraint` (an ``LLMatcher`` over that text), built in a
worker thread under a deadline.
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from concurrent.futures import Executor
from dataclasses import dataclass, field
from functools import cached_property

from lorapage.errors import InvalidRequestError
from lorapage.structured.spec import StructuredSpec, closed_objects

COMPILE_TIMEOUT_S = 5.0  # validating a spec or building a request's matcher, in a worker
CACHE_SIZE = 256  # validated grammars kept, by spec
# JSON output without free whitespace: a model that is not trained for JSON (or a random one)
# could otherwise pad between tokens without end. Applied after the schema's own x-guidance.
JSON_OVERRIDES = {"whitespace_flexible": False}
# A regex's \d, \w and \s (and \D, \W, \S) are ASCII classes, as vLLM's default grammar engine
# reads them ([0-9], [0-9a-zA-Z_], [ \t\n\r\f\v]), not the Rust regex crate's Unicode ones: a
# client asking for \d{4} wants '7469', not '٧469'. A schema's "pattern" is already read so
# (JSON Schema's regex dialect) for \d and \w.
REGEX_ASCII = "dws"


@dataclass(eq=False)
class Constraint:
    """One request's grammar state: which tokens may come next, advanced by each token it takes.

    Built off the loop; afterwards read on the forward thread (its next mask) and advanced on the
    loop (``consume``), never both at once: a request's row is in one step at a time.
    """

    matcher: object  # llguidance.LLMatcher
    spec: StructuredSpec = field(repr=False)

    def fill_mask(self, row_ptr: int, row_bytes: int) -> None:
        """Write the next allowed tokens as a bitmask (bit t of word t // 32) at ``row_ptr``."""
        self.matcher.unsafe_compute_mask_ptr(row_ptr, row_bytes)  # type: ignore[attr-defined]

    def consume(self, token: int) -> None:
        self.matcher.consume_token(token)  # type: ignore[attr-defined]

    @property
    def done(self) -> bool:
        """The grammar is complete and admits nothing more (EOS taken, or no extension)."""
        return bool(self.matcher.is_stopped())  # type: ignore[attr-defined]

    @property
    def error(self) -> str | None:
        """Why the output can no longer follow the grammar (a token it refused, a limit hit)."""
        return self.matcher.get_error() or None if self.matcher.is_error() else None  # type: ignore[attr-defined]


class GrammarCompiler:
    """Turns specs into :class:`Constraint` objects for one model's tokenizer and vocabulary."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: tuple[int, ...], executor: Executor):
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._executor = executor
        self._grammars: OrderedDict[StructuredSpec, str] = OrderedDict()

    @cached_property
    def _llg(self):
        import llguidance

        return llguidance

    @cached_property
    def tokenizer(self):
        """llguidance's view of the model's tokenizer (built once, in a worker, on first use)."""
        return self._llg.LLTokenizer(self._tokenizer_json, n_vocab=self.vocab_size, eos_token=self._eos or None)

    @cached_property
    def limits(self):
        return self._llg.LLParserLimits()

    async def constraint(self, spec: StructuredSpec) -> Constraint:
        """A fresh constraint for one request; :class:`InvalidRequestError` (naming ``spec.param``)
        when the spec does not compile or takes longer than :data:`COMPILE_TIMEOUT_S`."""
        loop = asyncio.get_running_loop()
        try:
            return await asyncio.wait_for(
                loop.run_in_executor(self._executor, self.constraint_now, spec), COMPILE_TIMEOUT_S
            )
        except TimeoutError:
            raise InvalidRequestError(
                f"{spec.param}: the {spec.kind} took longer than {COMPILE_TIMEOUT_S:g} s to compile; simplify it",
                param=spec.param,
            ) from None

    def constraint_now(self, spec: StructuredSpec) -> Constraint:
        """:meth:`constraint` in the calling thread (a worker's)."""
        grammar = self._grammar(spec)
        matcher = self._llg.LLMatcher(self.tokenizer, grammar, limits=self.limits, log_level=0)
        if matcher.is_error():
            raise _refused(spec, matcher.get_error())
        return Constraint(matcher, spec)

    def _grammar(self, spec: StructuredSpec) -> str:
        if (grammar := self._grammars.get(spec)) is not None:
            self._grammars.move_to_end(spec)
            return grammar
        grammar = self._text(spec)
        problem = self._llg.LLMatcher.validate_grammar(grammar, self.tokenizer, limits=self.limits)
        if problem:
            raise _refused(spec, problem)
        self._grammars[spec] = grammar
        while len(self._grammars) > CACHE_SIZE:
            self._grammars.popitem(last=False)
        return grammar

    def _text(self, spec: StructuredSpec) -> str:
        """llguidance's grammar text for ``spec``."""
        llg = self._llg
        try:
            if spec.kind == "json":
                schema = json.loads(spec.value)
                if not isinstance(schema, (dict, bool)):
                    raise ValueError("a JSON schema is an object (or true / false)")
                if spec.disable_additional_properties:
                    schema = closed_objects(schema)
                return llg.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OVERRIDES)
            if spec.kind == "json_object":
                return llg.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OVERRIDES)
            if spec.kind == "choice":
                return llg.grammar_from("choice", json.dumps(spec.choices(), ensure_ascii=False))
            if spec.kind == "regex":
                return llg.grammar_from("lark", f"start: /{llg.regex_to_lark(spec.value, REGEX_ASCII)}/")
            return llg.grammar_from("grammar", spec.value)
        except Exception as exc:  # the grammar engine refusing the caller's text, whatever the error's class
            raise _refused(spec, str(exc)) from None


def _refused(spec: StructuredSpec, why: str) -> InvalidRequestError:
    why = " ".join(why.split())
    why = why if len(why) <= 500 else why[:500] + "..."
    message = f"{spec.param}: the {spec.kind} cannot be used for structured output: {why}"
    return InvalidRequestError(message, param=spec.param)
