"""The scheduler: slots, windows and every count. The only owner of KV blocks."""

from strata.scheduler.scheduler import Scheduler
from strata.scheduler.slot import Slot
from strata.scheduler.window import Window

__all__ = ["Scheduler", "Slot", "Window"]
