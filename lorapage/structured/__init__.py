"""Structured output: constraints a request's output must follow (a JSON schema, a regular
expression, a set of choices, a grammar), compiled by llguidance and applied as per-row token
masks in the sampler, so constrained and free rows of any adapters share a step."""

from lorapage.structured.spec import STRUCTURED_KINDS, StructuredSpec

__all__ = ["STRUCTURED_KINDS", "StructuredSpec"]
