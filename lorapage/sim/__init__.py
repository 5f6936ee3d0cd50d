"""A discrete-event simulator that drives the real scheduling policies with a virtual clock."""

from lorapage.sim.simulator import CostModel, SimConfig, SimRequest, Simulator

__all__ = ["CostModel", "SimConfig", "SimRequest", "Simulator"]
