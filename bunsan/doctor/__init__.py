"""The doctor: advice when training runs out of memory (oom.py) or spends its step waiting for
communication (slow.py), and `bunsan doctor`'s checks before a long run (checks.py). Which rank a hung
collective waits for is the comm layer's roll call (comm/rollcall.py)."""

from bunsan.doctor.oom import OutOfMemory, is_oom

__all__ = ["OutOfMemory", "is_oom"]
