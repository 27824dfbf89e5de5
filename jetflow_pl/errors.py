"""Errors that mean "the user's input is wrong" (or the machine is), as opposed to a bug.

The command line prints these as one line (`error: ...`) instead of a traceback; anything else still
shows its traceback, because then the fault is ours. `docs/FAILURES.md` lists every such failure and its
message. All of them subclass a built-in (ValueError, RuntimeError, ...) so library callers who catch
the built-in keep working.
"""

from __future__ import annotations


class UserInputError(ValueError):
    """Bad configuration, data or paths: the message says what and where. CLI exit status 2."""


class MissingPathError(UserInputError, FileNotFoundError):
    """A path the user gave does not exist (also a FileNotFoundError for library callers)."""


class CheckpointError(UserInputError):
    """A weights file cannot be used: corrupt or truncated safetensors, or not safetensors at all.

    The message names the file, so a multi-file checkpoint points at the one to re-copy.
    """


class NumericalError(RuntimeError):
    """NaN/inf where a finite number is required (e.g. a float16 overflow in the draft head).

    Not a user-input error, but not a bug in the code either: the model and dtype produce it, and the
    message says which stage and what to change. CLI exit status 1, one line.
    """


def check_finite(x, what: str, where: str, advice: str) -> None:
    """Raise `NumericalError` when tensor `x` holds NaN or +inf (-inf log-probs are legitimate).

    One reduction on the device: the maximum is NaN when any element is (torch's max propagates NaN) and
    +inf when any element is +inf, so `not max < inf` is exactly "some NaN or +inf". It runs twice per
    decode round over `[N, vocab]` logits: the former `isnan().any() | isposinf().any()` (three passes
    and two temporaries) took 0.5 ms per call for 5 x 49,152 logits on one CPU thread, a few percent of a
    135M model's AR step; the maximum takes 0.02 ms. `what` names the model ("the draft head"), `where`
    the step, `advice` what to change; the decode loop and the cost profile both refuse non-finite
    numbers through this.
    """
    if x.numel() and not bool(x.amax() < float("inf")):
        raise NumericalError(f"{what} produced NaN/inf {where}: {advice}")
