"""The stages: one module per ``rlhf <stage>`` program, each its config dataclass, ``main(config)`` and ``cli(argv)``.

Every stage's body lives here, whether it is a few lines over the library (``generate``, ``score``) or a program of
its own (``train``, ``eval``); what two stages share lives below them in the library, or in the lower of the two
(``eval`` runs ``generate`` and ``score``; ``iterate`` plans every stage; ``demo`` runs ``iterate`` and ``report``).
:func:`run_stage` is what each ``cli`` calls: parse, run, and turn a mistake in the input into one ``error:`` line.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import Any, Callable, Sequence, TypeVar

from rlhf_pipeline.compat import allow_legacy_remote_code
from rlhf_pipeline.config import parse_config
from rlhf_pipeline.errors import FailedElsewhere, PipelineError, UserCodeError, redact
from rlhf_pipeline.files import writing
from rlhf_pipeline.machine import die_with_the_run

C = TypeVar("C")


def run_stage(config_cls: type[C], main_fn: Callable[[C], Any], prog: str, argv: Sequence[str] | None = None) -> int:
    """Parse the stage's config, run it, and turn a PipelineError into a one-line message (exit status 1, or the
    error's own).

    A UserCodeError (the user's reward function raised) prints the user's traceback first, then the one line, which
    names the stage. ``RLHF_DEBUG=1`` lets either propagate with the pipeline's whole traceback. A process of a
    launch (``accelerate launch``) ends here with its exit status (see :func:`_end_launched`).
    """
    return _end_launched(_run_stage(config_cls, main_fn, prog, argv))


def _end_launched(code: int) -> int:
    """One process (and every in-process call, as the tests make) gets ``code`` back. A process of a launch ends
    here, once the stage has written its outputs and destroyed its process group: finalizing the interpreter of a
    process that ran gloo collectives can abort it in C++ ("terminate called without an active exception", SIGABRT:
    seen in rare CI runs of the 2-process stages, after their outputs were complete), and the launcher then reports
    the whole launch as failed. So the streams are flushed and the process exits without that finalization."""
    from rlhf_pipeline.distributed import finish_distributed, launched

    if not launched():
        return code
    finish_distributed()  # a no-op when the stage destroyed its group, as every stage does
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _run_stage(config_cls: type[C], main_fn: Callable[[C], Any], prog: str, argv: Sequence[str] | None) -> int:
    die_with_the_run()
    logging.basicConfig(
        level=os.environ.get("RLHF_LOG_LEVEL", "WARNING").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    again = "run the same command again"
    try:
        config = parse_config(config_cls, argv, prog)
        if getattr(config, "trust_remote_code", False):  # a model's own code may run: let older code import
            allow_legacy_remote_code()
        if hasattr(config, "resume") and not config.resume:
            again += " with --resume"
        with writing(getattr(config, "output", None) or os.getcwd(), again=again):
            main_fn(config)
    except FailedElsewhere:  # another process of the launch failed, and the main process says why
        if os.environ.get("RLHF_DEBUG"):
            raise
        return 1
    except UserCodeError as e:
        if os.environ.get("RLHF_DEBUG"):
            raise
        _say(e.user_traceback() + f"error: {prog}: {e}")
        return 1
    except PipelineError as e:
        if os.environ.get("RLHF_DEBUG"):
            raise
        _say(f"error: {e}")
        return e.exit_status
    except KeyboardInterrupt:  # outputs are written atomically or resumably: a rerun continues where this stopped
        _say(f"interrupted; {again} to continue")
        return 130
    return 0


def _say(text: str) -> None:
    """``text`` on stderr, the Hub token left out (``errors.redact``), unless it cannot be written (a terminal
    closed under a stopped run): the exit status still says how the stage ended."""
    with contextlib.suppress(OSError):
        print(redact(text), file=sys.stderr)
