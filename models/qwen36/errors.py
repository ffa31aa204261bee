"""The one exception type for mistakes a user can fix: a bad argument, a missing or malformed checkpoint, a
device that is not there, a draft depth the kernels cannot hold.

``qwen36.cli.main`` catches :class:`UserError` once and prints ``error: <message>`` with exit status 2 and no
traceback, because the message already says what to change. Everything else (a bug, a failed numerics check,
an emulator rule violation) keeps its traceback. Library exceptions that describe user input subclass this
class together with the built-in type callers already catch (``ValueError``, ``RuntimeError``, ...), so code
that catches those keeps working.
"""
from __future__ import annotations

USER_ERROR_EXIT = 2  # argparse uses 2 for usage errors; a user mistake found later exits the same way


class UserError(Exception):
    """A problem in what the user asked for, stated so that the message alone tells them what to change."""
