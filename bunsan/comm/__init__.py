"""The only door to the other ranks.

collectives.py  Comm: every collective and p2p call, device-checked and recorded
work.py         Group, P2POp, handles, CommError / DeviceError
stats.py        per-step bytes and wait times of each op
shm.py, mailbox.py, exchange.py   same-host fast paths and the object exchange Comm uses
process_group.py   process start-up and device choice;  mesh.py: the (pp, dp, cp, tp) groups
along.py        all-gather / reduce-scatter along any dimension (activations cut by TP, SP and CP)
"""

from bunsan.comm.collectives import Comm
from bunsan.comm.mesh import Mesh
from bunsan.comm.work import CommError, DeviceError, Group, P2POp

__all__ = ["Comm", "CommError", "DeviceError", "Group", "Mesh", "P2POp"]
