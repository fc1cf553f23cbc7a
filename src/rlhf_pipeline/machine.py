"""What this process may use of the machine it runs on: its CPU cores and whether it sees a GPU, read without
importing torch (``rlhf iterate`` and ``rlhf demo`` decide with them how to give each side of an overlapped run its
share)."""

from __future__ import annotations

import os
from pathlib import Path


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
