"""The doctor: advice when training runs out of memory (oom.py), hangs in a collective (rollcall.py) or spends
its step waiting for communication (slow.py), and `bunsan doctor`'s checks before a long run (checks.py)."""

from bunsan.doctor.oom import OutOfMemory, is_oom
from bunsan.doctor.rollcall import post_step, roll_call

__all__ = ["OutOfMemory", "is_oom", "post_step", "roll_call"]
