"""Where a stage's engines run: ``--executor local`` (one engine in this process) or ``--executor ray`` (N engine
replicas on a Ray cluster, each on one contiguous shard of the work). All of the Ray code is here; a stage hands
:func:`run_on_ray` a function and one argument tuple per replica and gets the results back in shard order.

    rlhf generate ... --executor ray --replicas 2                              # a local Ray, started and stopped
    ray start --head                                                           # or a cluster: on the head node,
    ray start --address HEAD:6379                                              # on every other node,
    rlhf generate ... --executor ray --ray-address HEAD:6379 --replicas 8 --gpus-per-replica 2   # anywhere

Why Ray and not our own process management: the replicas of a dense model are independent engines (vLLM's offline
``LLM`` is data-parallel only for MoE models), and Ray already places them on nodes with free GPUs, ships their
arguments and results, notices a dead worker or node and reruns its task. A replica is a Ray task (not an actor):
it loads its engine, samples its shard, returns the samples and exits, so a retry starts from a clean process.
Each task is retried once, whether its function raised (``retry_exceptions``) or its worker or node died
(``max_retries``); a second failure cancels the others and fails the stage with one line. The driver (the process
that ran ``rlhf``) is the only writer: nothing reaches the output directory until every replica has returned.

Each replica reserves one CPU and ``--gpus-per-replica`` K GPUs. With K > 1 (vLLM tensor parallelism) the task
reserves no GPU itself and runs in a placement group of K bundles of one GPU and one CPU, packed on one node, which
vLLM's Ray backend then uses for its K workers (the shape of vLLM's own ``offline_inference_distributed`` example);
the task takes one bundle's CPU. A local Ray is started with K CPUs a replica to hold them.

The replicas import this package and read the model from the same path, so on a cluster every node needs the
package installed (``pip install 'rlhf-pipeline[ray]'``) and the model on a shared filesystem (or a Hub id);
prompts and samples travel through Ray's object store. A local Ray's workers inherit this process's environment.
"""

from __future__ import annotations

import importlib.util
import logging
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

from tqdm.auto import tqdm

from rlhf_pipeline.errors import PipelineError, one_line, redact

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'rlhf-pipeline[ray]' (Ray in this environment, and on every node of a cluster)"


def check_ray_installed() -> None:
    """Fail with one line, before anything is read or written, when ``--executor ray`` cannot import Ray."""
    try:
        found = importlib.util.find_spec("ray") is not None
    except ValueError:  # a module object without a spec (a stub put in sys.modules)
        found = False
    if not found:
        raise PipelineError(f"--executor ray: Ray is not installed; {INSTALL_HINT}, or use --executor local")


@contextmanager
def ray_session(address: str | None, num_cpus: int) -> Iterator[Any]:
    """Ray, connected: to the cluster at ``address``, or to a local Ray of ``num_cpus`` CPUs started here (no
    dashboard, warnings only) and stopped on the way out. A Ray this process had already initialised (a notebook,
    the tests) is used as it is and left running."""
    check_ray_installed()
    import ray

    if ray.is_initialized():
        yield ray
        return
    if address:
        _check_reachable(address)
    quiet = {"include_dashboard": False, "logging_level": logging.WARNING, "log_to_driver": True}
    started = time.perf_counter()
    try:
        if address:
            ray.init(address=address, **quiet)
        else:
            # "local": a new Ray of our own, even where `ray start` left one running (ray.init() would join that)
            ray.init(address="local", num_cpus=num_cpus, **quiet)
    except (ConnectionError, RuntimeError, ValueError) as e:
        where = f"--ray-address {address}" if address else "--executor ray"
        fix = ("start one with `ray start --head` (see docs/full-size.md, Several nodes) or drop --ray-address for a "
               "local Ray") if address else "check `ray start --head` works on this machine, or use --executor local"
        reason = redact(one_line(e, first_line_only=True))
        raise PipelineError(f"{where}: could not connect to Ray ({reason}); {fix}") from None
    log.info("ray: %s in %.1f s", f"connected to {address}" if address else "local Ray started",
             time.perf_counter() - started)
    try:
        yield ray
    finally:
        ray.shutdown()  # for a cluster this only disconnects: the cluster stays up


def _check_reachable(address: str) -> None:
    """A HOST:PORT nobody listens on fails now: ``ray.init`` would retry its connection for minutes first."""
    import socket

    host, _, port = address.rpartition(":")
    if "://" in address or not host or not port.isdigit():  # auto, or a ray:// client address: Ray's to resolve
        return
    try:
        socket.create_connection((host.removeprefix("[").removesuffix("]"), int(port)), timeout=10).close()  # [::1]
    except OSError as e:
        raise PipelineError(
            f"--ray-address {address}: nothing answers there ({e.strerror or e}); start the head node with "
            "`ray start --head --port PORT` and pass the address it prints, or drop --ray-address for a local Ray"
        ) from None


def _check_gpus(ray: Any, gpus_per_replica: int, replicas: int, address: str | None) -> None:
    """A replica needs its K GPUs on one node; a cluster with fewer would leave it pending for ever."""
    if gpus_per_replica == 0:
        return
    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    gpus = [int(n.get("GPU", 0)) for n in nodes]
    most = max(gpus, default=0)
    where = f"the Ray cluster at {address}" if address else "this machine"
    if most < gpus_per_replica:
        raise PipelineError(
            f"--gpus-per-replica {gpus_per_replica}: no node of {where} has that many GPUs (the most is {most}); "
            "join GPU nodes to the cluster, or pass --gpus-per-replica 0 for CPU replicas"
        )
    if gpus_per_replica > 1:
        # each replica's placement group (K GPUs and K CPUs on one node) is reserved up front and held until every
        # replica is done, so groups that do not fit would never be placed: refuse rather than wait for ever
        places = sum(min(int(n.get("GPU", 0)), int(n.get("CPU", 0))) // gpus_per_replica for n in nodes)
        if places < replicas:
            shown = ", ".join(f"{int(n.get('GPU', 0))} GPUs and {int(n.get('CPU', 0))} CPUs" for n in nodes)
            fix = f"pass at most --replicas {places}" if places else \
                f"start the GPU nodes with at least {gpus_per_replica} CPUs (ray start --num-cpus)"
            raise PipelineError(
                f"--replicas {replicas} x --gpus-per-replica {gpus_per_replica}: each replica needs "
                f"{gpus_per_replica} GPUs and as many CPUs on one node, and the nodes of {where} ({shown}) hold "
                f"{places} at once; {fix}"
            )
        return
    if sum(gpus) < gpus_per_replica * replicas:
        log.warning("ray: %d replicas x %d GPUs > the %d GPUs of %s; replicas will wait for each other",
                    replicas, gpus_per_replica, sum(gpus), where)


RETRY = {"max_retries": 1, "retry_exceptions": True}  # once, whether the function raised or its worker died


def _placement_group(ray: Any, gpus_per_replica: int, replica: str) -> Any:
    """A replica's K bundles of one GPU and one CPU, packed on one node: vLLM with tensor_parallel_size K inside the
    task starts its K workers there (they take a GPU each and no CPU), and the task takes one bundle's CPU (a task
    asking for a resource no bundle has could never be scheduled in the group)."""
    try:
        return ray.util.placement_group([{"GPU": 1, "CPU": 1}] * gpus_per_replica, strategy="STRICT_PACK")
    except Exception as e:  # Ray's checks of the request
        raise PipelineError(f"--executor ray: could not reserve {gpus_per_replica} GPUs on one node for {replica} "
                            f"({redact(one_line(e, first_line_only=True))})") from None


def _in_group(group: Any) -> dict[str, Any]:
    """Task options that run it in ``group`` (no GPU of its own), its child tasks and actors captured there too."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {"num_cpus": 1, "num_gpus": 0, **RETRY,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(group, placement_group_capture_child_tasks=True)}


def run_on_ray(
    fn: Callable[..., Any],
    jobs: Sequence[tuple],
    *,
    gpus_per_replica: int = 0,
    address: str | None = None,
    describe: Callable[[int], str] = lambda i: f"replica {i}",
    desc: str = "replicas",
) -> list[Any]:
    """``[fn(*job) for job in jobs]``, each call a Ray task on a replica of its own, the results in job order.

    A task that fails twice (its function raised, or its worker or node died, then again on the retry) cancels the
    others and raises a one-line PipelineError naming ``describe(i)`` and the cause; above it, Ray prints each
    failed attempt with the end of its traceback. ``fn`` must be importable by the workers (a module-level function of this package)."""
    with ray_session(address, num_cpus=len(jobs) * max(1, gpus_per_replica)) as ray:
        _check_gpus(ray, gpus_per_replica, len(jobs), address)
        started = time.perf_counter()
        task = ray.remote(fn)
        groups: list[Any] = []  # a placement group a replica when K > 1, all removed on the way out
        try:
            if gpus_per_replica > 1:
                for i in range(len(jobs)):
                    groups.append(_placement_group(ray, gpus_per_replica, describe(i)))
                options = [_in_group(group) for group in groups]
            else:
                options = [{"num_cpus": 1, "num_gpus": gpus_per_replica, **RETRY}] * len(jobs)
            return _gather(ray, [task.options(**o).remote(*job) for o, job in zip(options, jobs)], describe, desc,
                           started)
        finally:
            for group in groups:
                ray.util.remove_placement_group(group)


def _gather(ray: Any, refs: list, describe: Callable[[int], str], desc: str, started: float) -> list[Any]:
    """The tasks' results in order, a progress bar counting finished replicas; the first failure cancels the rest."""
    index = {ref: i for i, ref in enumerate(refs)}
    results: list[Any] = [None] * len(refs)
    pending = list(refs)
    with tqdm(total=len(refs), desc=desc, unit="replica") as bar:
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            i = index[done[0]]
            try:
                results[i] = ray.get(done[0])
            except ray.exceptions.RayError as e:
                for ref in pending:
                    ray.cancel(ref, force=True)
                cause = getattr(e, "cause", None)
                # the first line only: a RayTaskError's message goes on with the remote traceback
                reason = redact(one_line(cause if isinstance(cause, BaseException) else e, first_line_only=True))
                raise PipelineError(
                    f"--executor ray: {describe(i)} failed twice (once retried): {reason}; nothing was written"
                ) from None
            log.info("ray: %s done after %.1f s", describe(i), time.perf_counter() - started)
            bar.update(1)
    return results
