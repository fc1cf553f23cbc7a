"""Shared fixtures: tiny models built once per session, offline, and small prompt files."""

import functools
import importlib.util
import json
import os
import socket
from pathlib import Path

import pytest

os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from rlhf_pipeline.tiny import bundled_path  # noqa: E402

# tests/vllm_env runs in the vLLM environment (scripts/test.sh runs it there); the test environment never has vLLM.
collect_ignore = [] if importlib.util.find_spec("vllm") else ["vllm_env"]

REPO = Path(__file__).resolve().parents[1]


def pytest_collection_modifyitems(config, items):
    """The files that hold a test marked slow run first, in their order: scripts/test.sh spreads whole files over
    pytest-xdist workers in the order collected, so a long file started last would leave the other workers idle."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)  # stable: the order inside each group is kept


@pytest.fixture(autouse=True)
def _forget_hub_commits():
    """The Hub commits a process resolved are kept for the process (rlhf_pipeline.datasets_io.hub_commit); a test
    that fakes the Hub leaves none for the tests after it."""
    yield
    from rlhf_pipeline.datasets_io import hub_commit

    hub_commit.cache_clear()


@pytest.fixture(scope="session")
def tiny_policy(tmp_path_factory) -> str:
    from rlhf_pipeline.tiny import save_tiny_model

    return str(save_tiny_model(tmp_path_factory.mktemp("models") / "policy", kind="policy", seed=0))


@pytest.fixture(scope="session")
def tiny_rm(tmp_path_factory) -> str:
    from rlhf_pipeline.tiny import save_tiny_model

    return str(save_tiny_model(tmp_path_factory.mktemp("models") / "rm", kind="reward", seed=1))


@pytest.fixture(scope="session")
def bundled_prompts() -> str:
    return str(bundled_path("prompts.jsonl"))


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture
def small_prompts(tmp_path) -> str:
    rows = [json.loads(line) for line in bundled_path("prompts.jsonl").read_text().splitlines()[:12]]
    return write_jsonl(tmp_path / "prompts.jsonl", rows)


# A reward for the training tests: longer answers and answers that stopped are better, by several units.
LENGTH_REWARD = '''
def reward(prompts, responses, **columns):
    # Longer answers and answers that stopped are better: differences of several units between responses.
    return [len(r) / 20 + (2.0 if f == "stop" else 0.0) for r, f in zip(responses, columns["finish_reasons"])]
'''


@pytest.fixture
def fresh_accelerate_state():
    """Each in-process training run builds its own Accelerator; accelerate keeps singletons between them. Reset before
    the test too: a module's fixtures (a ref-logps pass making the test data) may have built one with other settings."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


_PORTS_PER_WORKER = 1000
_next_port = None


def free_port() -> int:
    """A free TCP port for a multi-process launch's rendezvous: one this test process has not handed out before, from
    a block of its own below the kernel's ephemeral range (32768 and up by default). Neither a socket another
    process opens (a gloo connection takes an ephemeral port) nor another pytest-xdist worker (each has its own
    block, 20000 + 1000 x its number) can take it between here and the launch binding it."""
    global _next_port
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    low = 20000 + _PORTS_PER_WORKER * (worker % 12)
    if _next_port is None:  # a start of its own, so that two test runs side by side seldom try the same ports
        _next_port = low + os.getpid() % _PORTS_PER_WORKER
    for _ in range(_PORTS_PER_WORKER):
        port = _next_port
        _next_port = low + (_next_port + 1 - low) % _PORTS_PER_WORKER
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue  # in use
            return port
    raise RuntimeError(f"no free port in {low}-{low + _PORTS_PER_WORKER - 1}")


def run(*args) -> int:
    """One ``rlhf`` command in-process; arguments may be paths or numbers."""
    from rlhf_pipeline.cli import main as rlhf

    return rlhf([str(a) for a in args])


def logged(path: Path, key: str = "loss/train") -> list[float]:
    """Every value of ``key`` in a training run's metrics.jsonl, in order."""
    return [r[key] for r in map(json.loads, (path / "metrics.jsonl").read_text().splitlines()) if key in r]


def assert_same_gradient_norms(a: Path, b: Path, rel: float = 1e-4) -> None:
    """Two training runs logged the same gradient norm at every step. Equal losses and weights alone do not show
    equal gradients: Adam (and clipping) is blind to a gradient scaled uniformly, by the accumulation steps say."""
    import pytest

    norms = logged(a, "grad_norm")
    assert norms and logged(b, "grad_norm") == pytest.approx(norms, rel=rel)


def max_weight_diff(a: Path, b: Path) -> float:
    """The largest absolute difference between two saved models' weights (same parameter names required)."""
    from safetensors.torch import load_file

    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys()
    return max((wa[k].float() - wb[k].float()).abs().max().item() for k in wa)


def spy_token_budget_plans(monkeypatch) -> list:
    """Record every plan ``training.loop.token_budget_plan`` makes from here on (one per step of an in-process run
    with --max-tokens-per-micro-batch), so that a test can check its budget cut micro-batches of several sizes."""
    from rlhf_pipeline.training import loop

    plans: list = []
    real = loop.token_budget_plan

    def plan(*args):
        plans.append(real(*args))
        return plans[-1]

    monkeypatch.setattr(loop, "token_budget_plan", plan)
    return plans


def micro_batch_sizes(plans: list) -> set[int]:
    """The sizes (examples) of the micro-batches of token-budget plans (``token_budget_plan``'s)."""
    return {len(chunk) for plan in plans for mine in plan for chunk in mine}


def make_stop_prone(model_dir: Path, likely: int, unlikely: tuple[int, ...] = (), logit: float = 0.6) -> None:
    """Rewrite a saved tiny policy so that token ``likely`` is probable after every token, ``unlikely`` improbable.

    Hidden dimension 0 of every input embedding is set to 1 (the others are ~0.02), so after the final RMSNorm every
    position's hidden state has a large, constant component there (~sqrt(hidden_size)); the LM head row of ``likely``
    reads it with weight ``logit``, those of ``unlikely`` with ``-logit``, every other row not at all. With
    ``logit=0.6`` the token takes about a third of the probability at each step: most samples stop within a dozen
    tokens, and some still reach the length limit.
    """
    from safetensors.torch import load_file, save_file

    weights = load_file(model_dir / "model.safetensors")
    embed, head = weights["model.embed_tokens.weight"], weights["lm_head.weight"]
    embed[:, 0] = 1.0
    head[:, 0] = 0.0
    head[likely, 0] = logit
    for token in unlikely:
        head[token, 0] = -logit
    save_file(weights, model_dir / "model.safetensors", metadata={"format": "pt"})


@pytest.fixture(scope="session")
def stop_prone_policy(tmp_path_factory) -> str:
    """The tiny policy with EOS made likely: about 60% of samples stop within 16 tokens, so both endings occur."""
    from transformers import AutoTokenizer

    from rlhf_pipeline.tiny import save_tiny_model

    path = save_tiny_model(tmp_path_factory.mktemp("models") / "stop_prone_policy", kind="policy", seed=0)
    make_stop_prone(path, AutoTokenizer.from_pretrained(path).eos_token_id, logit=0.4)
    return str(path)


class _KeptOpen:
    """An engine whose ``close`` (what a stage calls when it is done with it) leaves it running for the next test."""

    def __init__(self, engine):
        self._engine = engine

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def close(self) -> None:
        pass


@pytest.fixture(scope="session")
def shared_vllm_engines():
    """One vLLM engine per (model, dtype, context length) for a whole session of the real-vLLM suite (tests/vllm_env).

    vLLM takes 20-40 s to start an engine on 2 cores, so ``rlhf_pipeline.engines.load_engine`` is wrapped to keep the
    vLLM engines it builds: what a stage does with its engine is unchanged, only the start-up is shared. Tests that
    run a stage as its own process (the CLI, ``rlhf iterate`` with a vLLM launcher) start engines of their own.
    """
    import rlhf_pipeline.engines as engines

    real = engines.load_engine
    cache: dict = {}

    def load_engine(name, model, tokenizer, **kwargs):
        if engines.resolve_engine_name(name) != "vllm":
            return real(name, model, tokenizer, **kwargs)
        key = (str(Path(model).resolve()), kwargs.get("dtype", "auto"), kwargs.get("max_model_len"))
        if key not in cache:
            cache[key] = real(name, model, tokenizer, **kwargs)
        return _KeptOpen(cache[key])

    patch = pytest.MonkeyPatch()
    patch.setattr(engines, "load_engine", load_engine)
    yield cache
    patch.undo()
    for engine in cache.values():  # now, while pytest's output streams are open (vLLM logs its shutdown)
        engine.close()


@functools.cache
def cpu_zero_config(stage: int = 3) -> str:
    """The tests' DeepSpeed launch config: ``accelerate_cfgs/cpu_zero3.yaml`` (2 processes, gloo), at ZeRO ``stage``,
    with every weight partitioned under stage 3. DeepSpeed keeps a weight of fewer than
    ``stage3_param_persistence_threshold`` elements (1e5 by default) whole on every process, which is every weight of
    the tiny kit: with the shipped config no weight is ever gathered, and the collectives that hang or fail on real
    models would go untested."""
    import atexit
    import shutil
    import tempfile

    import yaml

    shipped = yaml.safe_load((REPO / "accelerate_cfgs" / "cpu_zero3.yaml").read_text())
    zero = shipped["deepspeed_config"]
    assert zero["offload_optimizer_device"] == zero["offload_param_device"] == "none", zero
    ds_config = {"zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                                       "stage3_gather_16bit_weights_on_model_save": zero["zero3_save_16bit_model"]},
                 "bf16": {"enabled": "auto"}, "train_micro_batch_size_per_gpu": "auto",
                 "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "train_batch_size": "auto"}
    directory = Path(tempfile.mkdtemp(prefix=f"cpu_zero{stage}_"))
    atexit.register(shutil.rmtree, directory, True)
    (directory / "ds.json").write_text(json.dumps(ds_config))
    # with a DeepSpeed config file accelerate refuses its own precision setting beside it: the run's --bf16 decides
    assert shipped.pop("mixed_precision") == "no", shipped
    config = dict(shipped, deepspeed_config={"deepspeed_config_file": str(directory / "ds.json"),
                                             "zero3_init_flag": zero["zero3_init_flag"]})
    (directory / "accelerate.yaml").write_text(yaml.safe_dump(config))
    return str(directory / "accelerate.yaml")


def accelerate_launch(target: list, timeout: int = 300, env: dict | None = None, stage: int = 3):
    """``accelerate launch`` of ``target`` (``-m MODULE ARGS...`` or ``SCRIPT ARGS...``) on 2 CPU processes under
    ZeRO ``stage`` (:func:`cpu_zero_config`); returns the finished process, whatever its exit status."""
    import subprocess
    import sys

    cmd = [str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file", cpu_zero_config(stage),
           "--main_process_port", str(free_port()), *map(str, target)]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)


def launch_cpu_zero3(stage_args: list, timeout: int = 300, stage: int = 3):
    """``rlhf STAGE ARGS...`` (``stage_args``) under :func:`accelerate_launch` (ZeRO ``stage``, 3 unless given),
    asserted to succeed; returns the finished process."""
    command, *args = stage_args
    res = accelerate_launch(["-m", f"rlhf_pipeline.stages.{command.replace('-', '_')}", *args], timeout, stage=stage)
    assert res.returncode == 0, launch_failure(res)
    return res


def launch_failure(res) -> str:
    """What a failed ``accelerate launch`` said: the end of its output (where a run got to) and of its errors, with
    the stderr lines that are only deprecation noise left out."""
    noise = ("FutureWarning", "return func(*args, **kwargs)")
    errors = "\n".join(line for line in res.stderr.splitlines() if not any(n in line for n in noise))
    return f"exit status {res.returncode}\n--- stdout (end) ---\n{res.stdout[-3000:]}\n--- stderr ---\n{errors[-6000:]}"


def crash_after_checkpoint(monkeypatch, step: int) -> None:
    """Make the next training run stop as Ctrl-C would (exit status 130) right after it writes its step-``step``
    checkpoint; the run after it (``--resume``) saves as usual."""
    from rlhf_pipeline.training import loop

    real_save = loop.save_checkpoint

    def save_then_stop(accelerator, model, tokenizer, output, state, **kwargs):
        path = real_save(accelerator, model, tokenizer, output, state, **kwargs)
        if state["step"] == step:
            monkeypatch.setattr(loop, "save_checkpoint", real_save)
            raise KeyboardInterrupt
        return path

    monkeypatch.setattr(loop, "save_checkpoint", save_then_stop)


def make_pairs(d: Path, policy: str, prompts: str, limit: int, test_size: int, max_new_tokens: int = 16,
               *extra_generate) -> Path:
    """generate (n=4) -> score (LENGTH_REWARD) -> filter (pairs) -> ref-logps into ``d``: gen, scored, pairs, ref."""
    (d / "reward.py").write_text(LENGTH_REWARD)
    assert run("generate", "--model", policy, "--prompts", prompts, "--output", d / "gen", "--n", 4,
               "--max-new-tokens", max_new_tokens, "--limit", limit, *extra_generate) == 0
    assert run("score", "--input", d / "gen", "--output", d / "scored", "--reward-fn", f"{d}/reward.py:reward") == 0
    assert run("filter", "--input", d / "scored", "--output", d / "pairs", "--tokenizer", policy,
               "--test-size", test_size) == 0
    assert run("ref-logps", "--model", policy, "--input", d / "pairs", "--output", d / "ref") == 0
    return d


def choice_logliks(model_dir: str, rows: list[dict]) -> list[list[float]]:
    """The bundled lm-eval task's oracle (tests/test_lm_eval.py, tests/vllm_env/test_vllm_lm_eval.py): each choice's
    summed log-prob after the task's prompt, computed directly: the prompt is rlhf_arith.yaml's
    ``Question: {question}\\nAnswer:``, each continuation " " + the choice; the continuation's tokens are those of
    the whole text after the prompt's (lm-eval's split, which keeps a word's merge across the boundary)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for row in rows:
        context = f"Question: {row['question']}\nAnswer:"
        scores = []
        for choice in row["choices"]:
            whole = tok(context + " " + choice)["input_ids"]
            n_ctx = len(tok(context)["input_ids"])
            with torch.no_grad():
                logp = model(torch.tensor([whole])).logits[0].float().log_softmax(-1)  # (T, V)
            scores.append(sum(logp[i - 1, whole[i]].item() for i in range(n_ctx, len(whole))))
        out.append(scores)
    return out


def armo_scores(model_dir, prompts: list[str], responses: list[str]) -> list[float]:
    """The oracle of a remote-code reward model (the tiny kit's ``armo`` kind, ArmoRM's layout): its own ``forward``,
    loaded with ``trust_remote_code=True``, on each conversation alone (the chat template's ids, no padding), read
    from the output's ``score`` (tests/test_remote_code_rm.py, tests/vllm_env/test_vllm_generate.py)."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from rlhf_pipeline.compat import allow_legacy_remote_code

    allow_legacy_remote_code()  # its code imports a name of transformers 4, as ArmoRM's does
    tok = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=False)  # a plain tokenizer: no code of its own
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, trust_remote_code=True,
                                                               dtype=torch.float32).eval()
    scores = []
    for prompt, response in zip(prompts, responses):
        conversation = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
        ids = tok.apply_chat_template(conversation, tokenize=True, return_dict=True)["input_ids"]
        with torch.no_grad():
            scores.append(model(input_ids=torch.tensor([ids])).score[0].item())
    return scores


def naive_sequence_logps(model, prompts, responses, temperature=1.0, softcap=None):
    """The log-prob oracle of tests/test_logprobs.py and tests/test_attention.py: one unpadded sequence at a time,
    full logits, full-vocab log_softmax, gather, sum over the response."""
    import torch

    totals = []
    for prompt, response in zip(prompts, responses):
        ids = torch.tensor([prompt + response])  # (1, L)
        length = ids.shape[1]
        logits = model(
            ids, attention_mask=torch.ones_like(ids), position_ids=torch.arange(length).unsqueeze(0)
        ).logits  # (1, L, V)
        logits = logits.double()
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        logp = torch.log_softmax(logits / temperature, dim=-1)
        next_logp = logp[0, :-1].gather(-1, ids[0, 1:].unsqueeze(-1)).squeeze(-1)  # (L-1,): logp of token t+1
        totals.append(next_logp[len(prompt) - 1 :].sum())  # positions len(prompt)-1 .. L-2 predict the response
    return torch.stack(totals)


def parameter_grads(model) -> dict:
    """Each parameter's gradient (a copy), by name: what a backward left on ``model``."""
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
