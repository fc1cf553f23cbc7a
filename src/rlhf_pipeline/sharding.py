"""Which prompts a ``rlhf generate --shard i/N`` run takes, and the seed of each prompt's request.

``rlhf generate`` splits its prompts into N contiguous slices; ``rlhf merge`` checks that the shards cover every
slice once; ``--executor ray`` gives the same slices to its replicas. Each prompt's seed depends only on the run's
``--seed`` and the prompt's row in the full prompt set, so with vLLM (and the hf engine at ``--batch-size 1``) a
prompt's samples do not depend on sharding or batching.
"""

from __future__ import annotations

import hashlib


def parse_shard(text: str) -> tuple[int, int]:
    """``"i/N"`` -> ``(i, N)`` with 0 <= i < N."""
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise ValueError(f"--shard {text!r}: expected i/N, e.g. 0/4") from None
    if not (n >= 1 and 0 <= i < n):
        raise ValueError(f"--shard {text!r}: need 0 <= i < N")
    return i, n


def shard_indices(num_rows: int, index: int, num_shards: int) -> range:
    """Rows of contiguous shard ``index`` (the first ``num_rows % num_shards`` shards get one row more)."""
    size, extra = divmod(num_rows, num_shards)
    start = index * size + min(index, extra)
    return range(start, start + size + (1 if index < extra else 0))


def request_seed(seed: int, row: int) -> int:
    """The seed of one prompt's request: depends on the run's seed and the prompt's row in the full prompt set."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{row}".encode()).digest()[:4], "little") & 0x7FFFFFFF
