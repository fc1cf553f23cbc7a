"""The exception types that reach the user as a one-line message instead of a traceback."""

from __future__ import annotations

import os
import re
import traceback
from typing import Any
from pathlib import Path

_PACKAGE = str(Path(__file__).resolve().parent)


class PipelineError(Exception):
    """A problem with the user's input or setup. The message names the file, the row and the fix."""

    exit_status = 1  # of the stage's process, after its one error line


class UserCodeError(PipelineError):
    """The user's own code (a ``--reward-fn`` function or its module) raised.

    Its traceback is the user's to read, so ``stages.run_stage`` prints it first (from the user's first frame on: the
    pipeline's frames above it are left out), then the one ``error:`` line, which names the stage, the function and
    the rows it was given. ``cause`` is the exception the user's code raised.
    """

    def __init__(self, message: str, cause: BaseException):
        super().__init__(message)
        self.cause = cause

    def user_traceback(self) -> str:
        """The cause's traceback (its chain included), from the first frame outside this package and the import
        machinery; with no such frame (a syntax error in the user's module), the exception alone, which shows the
        file, the line and where in it."""
        tb = self.cause.__traceback__
        while tb is not None and _ours(tb.tb_frame.f_code.co_filename):
            tb = tb.tb_next
        return "".join(traceback.format_exception(type(self.cause), self.cause, tb))


class ProcessFailed(UserCodeError):
    """A failure on another process of an ``accelerate launch``, reported by the main process: the message names the
    process and its error; ``traceback_text`` is what that process had to show (the user's traceback when a reward
    function raised there, the whole traceback of an unexpected error; empty for a PipelineError)."""

    def __init__(self, message: str, traceback_text: str = ""):
        PipelineError.__init__(self, message)
        self.cause = None
        self.traceback_text = traceback_text

    def user_traceback(self) -> str:
        return self.traceback_text


class FailedElsewhere(PipelineError):
    """Raised on the other processes of a launch when one process failed: the main process reports the error, so
    ``stages.run_stage`` exits on this one with status 1 and prints nothing."""


def _ours(filename: str) -> bool:
    if filename.startswith("<frozen importlib"):
        return True
    return str(Path(filename).resolve()).startswith(_PACKAGE + os.sep)


def one_line(exc: BaseException, *, first_line_only: bool = False) -> str:
    """``ExcType: message`` on one line, for an ``error:`` line: a multi-line message is joined (its whitespace
    collapsed), or with ``first_line_only`` cut to its first line, kept as it is; that is for messages whose later
    lines are not worth a one-line reason (a Ray task error carries the remote traceback). An empty message gives
    the type's name alone."""
    if first_line_only:
        lines = str(exc).strip().splitlines()
        return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


# Environment variables whose values are credentials (HF_TOKEN, WANDB_API_KEY, AWS_SECRET_ACCESS_KEY, ...)
SECRET_NAME = re.compile(r"TOKEN|KEY|SECRET|PASSWORD|PASSWD|CREDENTIAL|AUTH", re.IGNORECASE)


def redact_env(env: dict[str, Any]) -> dict[str, Any]:
    """``env`` (variables to values) as a record may show it: a credential's value replaced by ``***``."""
    return {name: "***" if SECRET_NAME.search(str(name)) else value for name, value in env.items()}


def redact(text: str) -> str:
    """``text`` without the Hub token: an error message can quote a request's headers, or a remote worker's
    environment."""
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        token = os.environ.get(name)
        if token and len(token) >= 4:
            text = text.replace(token, "***")
    return re.sub(r"\bhf_[A-Za-z0-9]{20,}\b", "hf_***", text)
