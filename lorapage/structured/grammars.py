"""Compiling structured-output specs with llguidance, off the event loop, bounded and cached.

llguidance was chosen over xgrammar (both measured in ``bench/bench_grammar.py``; docs/api.md
has the figures): it computes each step's mask lazily from an Earley parser over a lexer, so a
grammar costs nothing to "compile" ahead of time and a hostile schema cannot make a minutes-long
precompile; its work per step is bounded by :class:`llguidance.LLParserLimits` (lexer fuel,
parser items), which is what bounds a hostile grammar; it reads the model's ``tokenizer.json``
as is; and it installs as one dependency-free wheel (xgrammar needs transformers and triton).

A spec is compiled once: turned into llguidance's grammar text and validated (the text cached
by spec, LRU), then made into a fresh ``LLMatcher`` (cached too when its grammar is small: a
40 KB schema's matcher holds about 3 MB, so a big one is made again per request, in its
tenant's turn). Compiles run on grammar threads shared by the tenants in turn
(:class:`~lorapage.tenancy.fair_workers.FairWorkers`: one tenant's big schemas wait behind each other,
not in front of another tenant's), under a deadline past which the request is refused and the
compile no longer holds a thread the others need. Each branch of a request gets its own
:class:`Constraint`, a copy of one fresh matcher; a cached one is copied on the loop, behind no
compile.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from functools import cached_property
from typing import TypeVar

from lorapage.errors import InvalidRequestError
from lorapage.structured.spec import StructuredSpec, closed_objects
from lorapage.tenancy.fair_workers import FairWorkers

V = TypeVar("V")
COMPILE_TIMEOUT_S = 5.0  # compiling a spec (its wait for a thread included)
REASON_CHARS = 300  # of the grammar engine's reason in an answer
CACHE_SIZE = 256  # validated grammar texts kept, by spec
MATCHERS_CACHED = 32  # fresh matchers kept, by spec
MATCHER_CACHED_CHARS = 8 << 10  # of a grammar's text at most, for its matcher to be kept
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

    A copy of its spec's compiled matcher; read on the forward thread (its next mask) and advanced
    on the loop (``consume``), never both at once: a request's row is in one step at a time.
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
        if not self.matcher.is_error():  # type: ignore[attr-defined]
            return None
        return engine_reason(self.matcher.get_error() or "the grammar engine stopped")  # type: ignore[attr-defined]


class GrammarCompiler:
    """Turns specs into :class:`Constraint` objects for one model's tokenizer and vocabulary."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: tuple[int, ...], workers: FairWorkers):
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._workers = workers
        self._grammars: OrderedDict[StructuredSpec, str] = OrderedDict()  # spec -> its validated grammar text
        self._matchers: OrderedDict[StructuredSpec, object] = OrderedDict()  # spec -> a fresh LLMatcher of it
        self._lock = threading.Lock()  # the caches: read on the loop, filled by the grammar threads

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

    async def constraints(self, spec: StructuredSpec, n: int = 1, tenant: str = "") -> list[Constraint]:
        """``n`` fresh constraints for one request's branches, copies of one compile of ``spec``
        (in ``tenant``'s turn on the grammar threads, unless cached); :class:`InvalidRequestError`
        (naming ``spec.param``) when the spec does not compile or takes longer than
        :data:`COMPILE_TIMEOUT_S`."""
        fresh = self._cached(spec)
        if fresh is None:
            try:
                fresh = await self._workers.run(tenant, self._compile, spec, deadline_s=COMPILE_TIMEOUT_S)
            except TimeoutError:
                raise InvalidRequestError(
                    f"{spec.param}: the {spec.kind} took longer than {COMPILE_TIMEOUT_S:g} s to compile; simplify it",
                    param=spec.param,
                ) from None
        return [Constraint(fresh.deep_copy(), spec) for _ in range(n)]  # type: ignore[attr-defined]

    async def constraint(self, spec: StructuredSpec, tenant: str = "") -> Constraint:
        """One fresh constraint (:meth:`constraints`)."""
        return (await self.constraints(spec, 1, tenant))[0]

    def _cached(self, spec: StructuredSpec) -> object | None:
        with self._lock:
            return _lru_get(self._matchers, spec)

    def _compile(self, spec: StructuredSpec) -> object:
        """``spec``'s fresh matcher, compiled and cached (a grammar thread's work)."""
        if (fresh := self._cached(spec)) is not None:  # compiled while this waited its turn
            return fresh
        with self._lock:
            grammar = _lru_get(self._grammars, spec)
        if grammar is None:
            grammar = self._text(spec)
            problem = self._llg.LLMatcher.validate_grammar(grammar, self.tokenizer, limits=self.limits)
            if problem:
                raise _refused(spec, problem)
            with self._lock:
                _lru_put(self._grammars, spec, grammar, CACHE_SIZE)
        fresh = self._llg.LLMatcher(self.tokenizer, grammar, limits=self.limits, log_level=0)
        if fresh.is_error():
            raise _refused(spec, fresh.get_error())
        if len(grammar) <= MATCHER_CACHED_CHARS:
            with self._lock:
                _lru_put(self._matchers, spec, fresh, MATCHERS_CACHED)
        return fresh

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


def _lru_get(cache: OrderedDict[StructuredSpec, V], key: StructuredSpec) -> V | None:
    if (value := cache.get(key)) is not None:
        cache.move_to_end(key)
    return value


def _lru_put(cache: OrderedDict[StructuredSpec, V], key: StructuredSpec, value: V, size: int) -> None:
    cache[key] = value
    while len(cache) > size:
        cache.popitem(last=False)


def engine_reason(text: str) -> str:
    """The grammar engine's reason, bounded for an answer: llguidance appends its whole parser
    state and the grammar (the schema, up to 64 KiB) after ``<state>``; a client gets the reason."""
    why = " ".join(text.split("<state>", 1)[0].split())
    return why if len(why) <= REASON_CHARS else why[:REASON_CHARS] + "..."


def _refused(spec: StructuredSpec, why: str) -> InvalidRequestError:
    why = engine_reason(why)
    message = f"{spec.param}: the {spec.kind} cannot be used for structured output: {why}"
    return InvalidRequestError(message, param=spec.param)
