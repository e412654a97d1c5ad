"""Make vLLM's engine processes die with the server that owns them.

vLLM spawns its engine core and model worker as child processes. If the owning server
is killed outright (SIGKILL, OOM killer) they are re-parented to PID 1 and keep their
memory and cores. Ray kills whole process groups for its actors; standalone servers
(Kubernetes pods, `pdserve serve`) get the same guarantee from a tiny watchdog process
in the server's process group, which kills the group when the server disappears.
"""

from __future__ import annotations

import os
import subprocess
import sys

_WATCHDOG = """
import os, signal, sys, time
parent = int(sys.argv[1])
while True:
    time.sleep(0.5)
    if os.getppid() != parent:
        os.killpg(os.getpgid(0), signal.SIGKILL)
"""


def reap_children_on_exit() -> None:
    """Lead a process group and start the watchdog. Call before the engine starts."""
    if os.getpgrp() != os.getpid():
        # Our own group, so the watchdog never kills the processes that started us.
        os.setpgid(0, 0)
    subprocess.Popen(
        [sys.executable, "-c", _WATCHDOG, str(os.getpid())],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        close_fds=True,
    )
