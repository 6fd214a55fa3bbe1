"""Algorithms generate schedules; they never send a byte. See ``schedule.py`` for the model."""

from . import direct, ring, rooted
from .schedule import Kind, Region, Schedule, Step

__all__ = ["Kind", "Region", "Schedule", "Step", "direct", "ring", "rooted"]
