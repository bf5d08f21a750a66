"""Optimizers (one table, optimizers.py), how each steps and where it may (stepping.py), and learning-rate
schedules (schedule.py)."""

from bunsan.optim.stepping import declare

__all__ = ["declare"]
