"""What every benchmark shares: the result record, side-by-side alternating timing, and the writers.

Machines here are noisy, so a comparison never times one side and then the other: the two sides alternate round by
round in the same process run (ours, peer, ours, peer, ...), and the result is the ratio of their medians. Absolute
times are context only.
"""

from __future__ import annotations

import gc
import json
import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional


@dataclass
class Entry:
    """One line of benchmarks.json. ``ratio > 1`` means we are better; ``target`` is the ratio we promise.

    An entry whose best possible ratio can be measured on the machine that runs it also carries that ``ceiling``
    (the peer's time over the irreducible part of ours, e.g. the reward model's batched forwards alone) and a
    ``ceiling_target``, the fraction of the ceiling ours must reach (``ratio / ceiling``). Where the ratio target is
    above the ceiling it cannot be met on this machine (the score entry's 5x is for GPUs, where the forwards are
    cheap; a CPU's ceiling is about 4): there the fraction is judged instead, so the stage slowing down still shows;
    where the ratio target is within reach, it is judged and the fraction only reported.
    """

    name: str
    ours: float
    peer: float
    unit: str
    ratio: float
    target: Optional[float]
    notes: str
    details: dict[str, Any] = field(default_factory=dict)  # per-round figures, sizes, anything worth keeping
    ceiling: Optional[float] = None  # the best ratio this machine allows
    ceiling_target: Optional[float] = None  # the least fraction of the ceiling to reach
    lower_is_better: bool = False  # ``ours`` itself is judged: at most ``target`` (a growth exponent, say)

    @property
    def ceiling_fraction(self) -> Optional[float]:
        return None if self.ceiling is None else self.ratio / self.ceiling

    @property
    def target_reachable(self) -> bool:
        """Whether the ratio target can be met here: no ceiling measured, or a ceiling at or above the target."""
        return self.target is None or self.ceiling is None or self.ceiling >= self.target

    @property
    def met(self) -> Optional[bool]:
        if self.lower_is_better:
            return None if self.target is None else self.ours <= self.target
        checks = []
        if self.target is not None and self.target_reachable:
            checks.append(self.ratio >= self.target)
        if self.ceiling_target is not None and not self.target_reachable:
            checks.append(self.ceiling_fraction >= self.ceiling_target)
        return None if not checks else all(checks)

    def status(self) -> str:
        """How the entry stands, in words, for the console and the table's last column."""
        if self.met is None:
            return "—"
        if self.lower_is_better:
            return ("ok" if self.met else "MISSED") + f": {self.ours:.2f} vs at most {self.target:g}"
        parts = []
        if self.target is not None:
            parts.append(f"ratio {self.ratio:.2f} vs {self.target:g}" + ("" if self.target_reachable else
                                                                          " (above this machine's ceiling)"))
        if self.ceiling is not None:
            parts.append(f"{self.ceiling_fraction:.2f} of ceiling {self.ceiling:.2f}"
                         + ("" if self.ceiling_target is None or self.target_reachable else f" vs {self.ceiling_target:g}"))
        return ("ok" if self.met else "MISSED") + ": " + "; ".join(parts)


def alternate(ours: Callable[[], Any], peer: Callable[[], Any], rounds: int, warmup: bool = True,
              also: Optional[dict[str, Callable[[], Any]]] = None) -> dict[str, Any]:
    """Time ``ours()`` and ``peer()`` alternately for ``rounds`` rounds (after one untimed warm-up call of each).

    Returns the per-round seconds of both sides, their medians and ``ratio = median(peer) / median(ours)`` (> 1:
    ours is faster), plus the last value each side returned. ``also`` names more callables timed in the same
    rounds (``<name>_seconds``, ``<name>_median``, ``<name>_value``): a bound on ours measured beside it, so that the
    machine's drift over the run moves both alike instead of one measured after the other.
    """
    sides = [("ours", ours), ("peer", peer), *(also or {}).items()]
    results: dict[str, Any] = {}
    if warmup:
        for side, fn in sides:
            results[f"{side}_value"] = fn()
    times: dict[str, list[float]] = {side: [] for side, _ in sides}
    for r in range(rounds):
        # Rotate the order every round (ours, peer / peer, ours with two sides), so that no side always runs on a
        # machine another just warmed or heated.
        order = sides[r % len(sides):] + sides[: r % len(sides)]
        for side, fn in order:
            gc.collect()
            t0 = time.perf_counter()
            results[f"{side}_value"] = fn()
            times[side].append(time.perf_counter() - t0)
    for side, _ in sides:
        results[f"{side}_seconds"] = times[side]
        results[f"{side}_median"] = statistics.median(times[side])
        results.setdefault(f"{side}_value", None)
    results["ratio"] = results["peer_median"] / results["ours_median"]
    return results


def growth_exponent(sizes: list[float], seconds: list[float]) -> float:
    """The slope of log(seconds) against log(size), least squares: ~1 means time grows linearly with size."""
    xs, ys = [math.log(s) for s in sizes], [math.log(t) for t in seconds]
    mx, my = statistics.mean(xs), statistics.mean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def _fmt(value: float) -> str:
    if value == 0 or 0.01 <= abs(value) < 100_000:
        return f"{value:.3g}" if abs(value) < 100 else f"{value:,.0f}"
    return f"{value:.3g}"


def write_results(output: Path, entries: list[Entry], context: dict[str, Any], records: list[dict[str, Any]]) -> None:
    """``benchmarks.json`` (the entries) and ``BENCHMARKS.md`` (a table of them, the notes, and ``records``: figures
    kept without a target, such as stage time against data size)."""
    from rlhf_pipeline.datasets_io import write_text_atomic

    output.mkdir(parents=True, exist_ok=True)
    payload = [{k: v for k, v in asdict(e).items()} for e in entries]
    write_text_atomic(output / "benchmarks.json", json.dumps(payload, indent=2) + "\n")

    lines = ["# Benchmarks", ""]
    lines += [f"- {k}: {v}" for k, v in context.items()]
    lines += ["", "Ratio > 1 means rlhf-pipeline is better. Each comparison alternates both sides in one run; the ratio "
              "is of medians over the rounds.", "",
              "| benchmark | ours | peer | unit | ratio | target | of ceiling (target) | met |",
              "|---|---|---|---|---|---|---|---|"]
    for e in entries:
        met = "—" if e.met is None else ("yes" if e.met else "**no**")
        target = "—" if e.target is None else (f"ours ≤ {e.target:g}" if e.lower_is_better else f"≥ {e.target:g}"
                                               + ("" if e.target_reachable else " (not judged here)"))
        ceiling = "—" if e.ceiling is None else (
            f"{e.ceiling_fraction:.2f} of {e.ceiling:.2f}" + ("" if e.ceiling_target is None else
                                                             f" (≥ {e.ceiling_target:g})"))
        lines.append(f"| `{e.name}` | {_fmt(e.ours)} | {_fmt(e.peer)} | {e.unit} | {e.ratio:.2f} | {target} | "
                     f"{ceiling} | {met} |")
    lines += ["", "## Notes", ""]
    for e in entries:
        lines += [f"**`{e.name}`**: {e.notes}", ""]
    for record in records:
        lines += [f"## {record['title']}", "", record["markdown"], ""]
    write_text_atomic(output / "BENCHMARKS.md", "\n".join(lines).rstrip() + "\n")
