"""PID 1 of a simulated machine (tests/node_harness.py): runs the node's command and stays up, reaping, until
no process is left in the namespace, as a real machine's init keeps an orphaned worker running. (Were the
agent itself PID 1, the kernel would kill every process of the namespace with it, hiding orphans.) Exits with
the command's code (128 + signal when a signal ended it)."""

import os
import subprocess
import sys

child = subprocess.Popen(sys.argv[1:])
code = None
while True:
    try:
        pid, status = os.wait()          # the command, or an orphan re-parented to PID 1
    except ChildProcessError:            # nothing left
        break
    if pid == child.pid:
        code = os.waitstatus_to_exitcode(status)
        child.returncode = code
sys.exit(code if code >= 0 else 128 - code)
