"""Errors that mean "the user's input is wrong", as opposed to a bug.

The command line prints these as one line (`error: ...`) with exit status 2 instead of a traceback;
anything else still shows its traceback, because then the fault is ours.
"""

from __future__ import annotations


class UserInputError(ValueError):
    """Bad configuration, data or paths: the message says what and where."""
