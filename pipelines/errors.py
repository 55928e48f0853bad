"""Errors the job reports to the user as one readable block instead of a traceback wall.

:class:`PreflightError`: the configuration does not fit the world (a missing object, a wrong
endpoint, a local path on a multi-node cluster); one line, exit code 2.

:class:`StageError`: a stage failed for a reason the user can act on (an actor could not
load a posterior from a URI, a worker's code raised). Raised on the driver with the cause's
own message (which names the URI); ``pipelines.cli.main.main`` prints it and exits with code 1.
"""
from __future__ import annotations

import re

__all__ = ["PreflightError", "StageError", "cause_line", "DETERMINISTIC", "is_deterministic", "error_line", "root_error"]

#: Exceptions that a retry would raise again: the code's or the input's (a bad weights file, a key
#: that does not exist, a shape that does not fit), not the cluster's (a lost worker or node).
DETERMINISTIC: tuple[type[BaseException], ...] = (ValueError, TypeError, LookupError, AttributeError,
                                                  NotImplementedError, ArithmeticError)


def root_error(error: BaseException) -> BaseException:
    """The user's exception inside Ray Train's wrapper (which keeps it with its traceback text)."""
    inner = getattr(error, "_base_exc", None)
    return inner if isinstance(inner, BaseException) else error


#: torch's messages for a tensor shape that does not fit the model (raised as RuntimeError or, by
#: torchvision's ViT, AssertionError): the same input fails the same way on every retry.
_SHAPE_MISMATCH = re.compile(r"shapes cannot be multiplied|size mismatch|must match the size of tensor|"
                             r"Given groups=\d+, weight of size|Wrong image (height|width)")


def is_deterministic(error: BaseException) -> bool:
    """Whether a retry would fail the same way (:data:`DETERMINISTIC`, or torch's shape mismatch)."""
    e = root_error(error)
    return isinstance(e, DETERMINISTIC) or (isinstance(e, (RuntimeError, AssertionError))
                                            and bool(_SHAPE_MISMATCH.search(str(e))))


def error_line(error: BaseException) -> str:
    """``Type: message`` in one line."""
    e = root_error(error)
    return f"{type(e).__name__}: {' '.join(str(e).split())[:400]}"

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_EXC_LINE = re.compile(r"^([A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)|[A-Z]\w*Error)\b(:.*)?$")


class PreflightError(ValueError):
    """A problem found before any cluster work (or once the cluster's shape is known, before
    any pass), stated in one line; the job exits with code 2."""


class StageError(RuntimeError):
    """A stage failed; ``str(e)`` is the whole message for the user (one block, no traceback)."""


def cause_line(error: BaseException | str) -> str:
    """The ``Type: message`` line of the innermost exception in ``error`` (a Ray error's text
    carries the remote traceback; its last exception line is the cause), ANSI colours removed."""
    text = _ANSI.sub("", str(error))
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    for ln in reversed(lines):
        if _EXC_LINE.match(ln):
            return ln
    cause = getattr(error, "cause", None)
    if isinstance(cause, BaseException):
        return f"{type(cause).__name__}: {cause}"
    return lines[-1] if lines else type(error).__name__ if isinstance(error, BaseException) else "unknown error"
