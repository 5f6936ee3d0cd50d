"""What a request's output must follow, as plain data: no grammar engine is imported here.

A :class:`StructuredSpec` travels in :class:`~lorapage.sampling_params.SamplingParams`; the
engine compiles it (:mod:`lorapage.structured.grammars`) before the request queues. Sizes are
bounded here, so a hostile spec costs nothing before it is refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from lorapage.errors import InvalidRequestError

# kind -> what ``value`` holds. The names follow vLLM's structured outputs (guided_json, ...).
STRUCTURED_KINDS = {
    "json": "a JSON schema (JSON text)",
    "json_object": "any JSON object (value unused)",
    "regex": "a regular expression (Rust regex syntax; \\d, \\w, \\s are ASCII classes, as vLLM reads them)",
    "choice": "a JSON list of strings, one of which is the whole output",
    "grammar": "a context-free grammar in Lark or GBNF (llama.cpp) syntax",
}
MAX_SPEC_CHARS = 64 * 1024  # a schema, pattern or grammar's text
MAX_CHOICES = 256
MAX_CHOICE_CHARS = 1024


@dataclass(frozen=True)
class StructuredSpec:
    """One constraint: ``kind`` (a key of :data:`STRUCTURED_KINDS`) and its text ``value``.
    ``param`` names the request field it came from, for errors (``response_format``,
    ``guided_json``, ``tool_choice``...)."""

    kind: str
    value: str = ""
    param: str = "response_format"
    # vLLM's option of the same name: a JSON schema's objects that do not say otherwise take no
    # properties beyond those they name (:func:`closed_objects`). True by default, as vLLM's
    # default grammar engine reads schemas; False reads the schema as JSON Schema does (extra
    # keys allowed unless ``"additionalProperties": false``).
    disable_additional_properties: bool = True

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise InvalidRequestError(
                f"structured output kind must be one of {', '.join(STRUCTURED_KINDS)}; got {self.kind!r}",
                param=self.param,
            )
        if not isinstance(self.value, str) or len(self.value) > MAX_SPEC_CHARS:
            size = len(self.value) if isinstance(self.value, str) else type(self.value).__name__
            raise InvalidRequestError(
                f"{self.param}: the {self.kind} must be text of at most {MAX_SPEC_CHARS} characters; got {size}",
                param=self.param,
            )
        if self.kind == "choice":
            self.choices()  # checked now, so a bad list never reaches the compiler
        if self.kind in ("regex", "grammar", "json") and not self.value.strip():
            raise InvalidRequestError(f"{self.param}: the {self.kind} is empty", param=self.param)

    @classmethod
    def of_choices(cls, choices: list[str] | tuple[str, ...], param: str = "guided_choice") -> StructuredSpec:
        return cls("choice", json.dumps(list(choices), ensure_ascii=False), param)

    def choices(self) -> list[str]:
        """The allowed outputs of a ``choice`` spec, checked."""
        try:
            items = json.loads(self.value)
        except ValueError:
            items = None
        if not isinstance(items, list) or not items or not all(isinstance(c, str) and c for c in items):
            raise InvalidRequestError(f"{self.param}: choices must be a non-empty list of non-empty strings")
        if len(items) > MAX_CHOICES or any(len(c) > MAX_CHOICE_CHARS for c in items):
            raise InvalidRequestError(
                f"{self.param}: at most {MAX_CHOICES} choices of at most {MAX_CHOICE_CHARS} characters each",
                param=self.param,
            )
        return items


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_VALUES = ("const", "enum", "default", "examples")


def closed_objects(schema: Any) -> Any:
    """``schema`` with ``"additionalProperties": false`` added to every object in it (nested ones,
    ``$defs`` and the branches of ``anyOf`` included) that names ``properties`` or
    ``patternProperties`` and says nothing of ``additionalProperties``: what vLLM's
    ``disable_additional_properties`` does, and how its default engine (xgrammar) reads a schema.
    instructor's JSON_SCHEMA mode, LangChain's dict schemas and ``guided_json=Model.model_json_schema()``
    send schemas without it and count on it. ``schema`` is not changed (a copy is returned)."""
    if isinstance(schema, list):
        return [closed_objects(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _VALUES:  # data, not schemas: left as they are
            out[key] = value
        elif key in _SCHEMA_MAPS and isinstance(value, dict):  # names -> schemas: the names are no keywords
            out[key] = {name: closed_objects(sub) for name, sub in value.items()}
        else:
            out[key] = closed_objects(value)
    if "additionalProperties" not in out and ("properties" in out or "patternProperties" in out):
        out["additionalProperties"] = False
    return out
