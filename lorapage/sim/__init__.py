"""A discrete-event simulator that drives the real scheduling policies with a virtual clock."""

from typing import TYPE_CHECKING

from lorapage._exports import lazy

if TYPE_CHECKING:
    from lorapage.sim.simulator import (
        CostModel as CostModel,
        SimConfig as SimConfig,
        SimRequest as SimRequest,
        Simulator as Simulator,
    )

__getattr__, __dir__, __all__ = lazy(
    __name__,
    {
        "CostModel": "lorapage.sim.simulator",
        "SimConfig": "lorapage.sim.simulator",
        "SimRequest": "lorapage.sim.simulator",
        "Simulator": "lorapage.sim.simulator",
    },
)
