"""What this process may use of the machine it runs on: its CPU cores and whether it sees a GPU, read without
importing torch (``rlhf iterate`` and ``rlhf demo`` decide with them how to give each side of an overlapped run its
share); and that a stage ``rlhf iterate`` launched does not outlive it."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

# Set by rlhf iterate in each stage's environment: its own pid (see die_with_the_run)
RUN_PID = "RLHF_ITERATE_PID"


def usable_cores() -> list[int]:
    """The CPU cores this process may run on (its affinity: a container's or taskset's share, not the machine's)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return list(range(os.cpu_count() or 1))


def gpus_visible() -> bool:
    """Whether this machine's NVIDIA driver lists a GPU and this process may use one (``CUDA_VISIBLE_DEVICES`` is
    not set empty)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) == "":
        return False
    gpus = Path("/proc/driver/nvidia/gpus")
    return gpus.is_dir() and any(gpus.iterdir())


def die_with_parent() -> None:
    """On Linux, have this process sent SIGTERM when its parent dies (a SIGKILL of the parent included)."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def die_with_the_run() -> None:
    """In a process of a stage that ``rlhf iterate`` launched (``RLHF_ITERATE_PID`` in its environment): SIGTERM to it
    when its parent dies. Iterate's own child gets that from iterate; a launcher between them (``accelerate launch``
    of one process, ``conda run``) exits on it without passing it on, and the stage under it would go on writing
    beside the rerun that resumes the run. With every process of the chain dying with its parent, a killed iterate
    takes them all. An iterate already gone (killed before this line) stops this process now."""
    pid = os.environ.get(RUN_PID)
    if not pid or sys.platform != "linux":
        return
    die_with_parent()
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        os.kill(os.getpid(), signal.SIGTERM)
    except (OSError, ValueError):  # another user's process by that pid, or not a pid: nothing to tell
        pass
