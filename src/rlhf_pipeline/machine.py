"""What this process may use of the machine it runs on: its CPU cores and whether it sees a GPU, read without
importing torch (``rlhf iterate`` and ``rlhf demo`` decide with them how to give each side of an overlapped run its
share); and that a stage ``rlhf iterate`` launched does not outlive it."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

# Set by rlhf iterate in each stage's environment: where it runs and its pid (run_identity, die_with_the_run)
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


def _prctl(option: int, value: int) -> None:
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(option, value)


def die_with_parent() -> None:
    """On Linux, have this process sent SIGTERM when its parent dies (a SIGKILL of the parent included)."""
    PR_SET_PDEATHSIG = 1
    _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def adopt_orphans(on: bool) -> None:
    """On Linux, make this process the one that the orphans among its descendants are given to (a child subreaper),
    or no longer: a stage whose launcher exits before it (``accelerate launch`` on Ctrl-C) stays in reach."""
    PR_SET_CHILD_SUBREAPER = 36
    if sys.platform == "linux":
        _prctl(PR_SET_CHILD_SUBREAPER, int(on))


def _here() -> str:
    """This machine's boot and this process's pid namespace: where a pid names the same process."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return ""
    return f"{boot}:{namespace}"


def _start_time(pid: int) -> str:
    """When process ``pid`` started, in clock ticks since boot (``/proc/PID/stat``'s 22nd field): with the pid, it
    names one process, where a pid alone may be given to another once its process has ended."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat[stat.rindex(")") + 2:].split()[19]  # the fields after the command's name start at the 3rd


def run_identity() -> str:
    """What ``rlhf iterate`` puts in ``RLHF_ITERATE_PID`` for its stages: where it runs, when it started and its
    pid."""
    return f"{_here()}:{_start_time(os.getpid())}:{os.getpid()}"


def die_with_the_run() -> None:
    """In a process of a stage that ``rlhf iterate`` launched (``RLHF_ITERATE_PID`` in its environment), on the same
    machine and in its pid namespace: a thread that sends this process SIGTERM once iterate has ended, a SIGKILL
    included. Iterate's own child dies with it (the parent-death signal iterate sets); a launcher between them
    (``accelerate launch`` of one process, ``conda run``) exits without passing anything on, and the stage under it
    would go on writing beside the rerun that resumes the run. The stage watches iterate itself, not its parent, so a
    launcher that exits first on Ctrl-C does not cut the stage's clean-up short (iterate waits for it). An iterate
    already gone stops this process now. A launcher that carries the environment to another machine or namespace
    (``srun``) leaves the stage alone."""
    parts = os.environ.get(RUN_PID, "").rsplit(":", 2)  # BOOT:NAMESPACE, START, PID
    if sys.platform != "linux" or len(parts) != 3 or not parts[2].isdigit() or not parts[0] or parts[0] != _here():
        return
    started, pid = parts[1], int(parts[2])
    alive = True
    try:
        handle: int | None = os.pidfd_open(pid)
    except ProcessLookupError:
        handle, alive = None, False
    except OSError:  # a kernel before 5.3: look every second instead
        handle = None
    # gone, or its pid another process's now (the start time is read once the pid is held: it cannot change after)
    if not alive or _start_time(pid) != started:
        os.kill(os.getpid(), signal.SIGTERM)
        return

    def watch() -> None:
        import select
        import time

        if handle is not None:
            select.select([handle], [], [])  # readable once the process has ended
        else:
            while True:
                time.sleep(1.0)
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                except OSError:  # another user's process by now: iterate is gone
                    break
        os.kill(os.getpid(), signal.SIGTERM)

    import threading

    threading.Thread(target=watch, name="die-with-the-run", daemon=True).start()
