"""Capacity planning: the design's sizing arithmetic (``lorapage plan``)."""
