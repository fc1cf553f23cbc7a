"""The one exception type that reaches the user as a one-line message instead of a traceback."""


class PipelineError(Exception):
    """A problem with the user's input or setup. The message names the file, the row and the fix."""
