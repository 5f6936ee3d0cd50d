"""Structured output: constraints a request's output must follow (a JSON schema, a regular
expression, a set of choices, a grammar), compiled by llguidance and applied as per-row token
masks in the sampler, so constrained and free rows of any adapters share a step."""

from typing import TYPE_CHECKING

from lorapage._exports import lazy

if TYPE_CHECKING:
    from lorapage.structured.spec import STRUCTURED_KINDS as STRUCTURED_KINDS, StructuredSpec as StructuredSpec

__getattr__, __dir__, __all__ = lazy(
    __name__,
    {
        "STRUCTURED_KINDS": "lorapage.structured.spec",
        "StructuredSpec": "lorapage.structured.spec",
    },
)
