"""Cost attribution per tenant and adapter version, by the hour (see :mod:`lorapage.usage.ledger`)."""

from lorapage.usage.ledger import USAGE_FIELDS, StepRow, Usage, UsageLedger

__all__ = ["USAGE_FIELDS", "StepRow", "Usage", "UsageLedger"]
