"""Cost attribution per tenant and adapter version, by the hour (see :mod:`lorapage.usage.ledger`)."""

from typing import TYPE_CHECKING

from lorapage._exports import lazy

if TYPE_CHECKING:
    from lorapage.usage.ledger import (
        USAGE_FIELDS as USAGE_FIELDS,
        StepRow as StepRow,
        Usage as Usage,
        UsageLedger as UsageLedger,
    )

__getattr__, __dir__, __all__ = lazy(
    __name__,
    {
        "USAGE_FIELDS": "lorapage.usage.ledger",
        "StepRow": "lorapage.usage.ledger",
        "Usage": "lorapage.usage.ledger",
        "UsageLedger": "lorapage.usage.ledger",
    },
)
