"""Optimizers (one table, optimizers.py) and learning-rate schedules (schedule.py)."""
