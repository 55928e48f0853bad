"""Errors the job reports to the user as one readable block instead of a traceback wall.

:class:`PreflightError`: the configuration does not fit the world (a missing object, a wrong
endpoint, a local path on a multi-node cluster); one line, exit code 2.

:class:`StageError`: a stage failed for a reason the user can act on (an actor could not
load a posterior from a URI, a worker's code raised). Raised on the driver with the cause's
own message (which names the URI); ``pipelines.cli.main.main`` prints it and exits with code 1.
"""
from __future__ import annotations

import re

__all__ = ["PreflightError", "StageError", "cause_line", "DETERMINISTIC", "is_deterministic", "error_line",
           "root_error", "memory_line"]

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


_KILLED = re.compile(r"(\d+) worker\(s\) were killed due to the node running low on memory")
_NODE = re.compile(r"Memory on the node \(IP: ([^,]+), ID: \w+\) was ([\d.]+)GB used / ([\d.]+)GB limit")
_TOP = re.compile(r"Top \d+ memory users:[^\n]*\n\s*(\d+)\s+([\d.]+)\s+(\S+)")


def memory_line(error: BaseException) -> str | None:
    """One line for Ray's memory monitor killing workers (its ``OutOfMemoryError``, which Ray Tune
    re-raises inside a ``RuntimeError`` with a page of object-store statistics): how many, the
    node's memory, and the largest process; ``None`` for any other error (its chain included)."""
    seen, e = set(), error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        text = _ANSI.sub("", str(e))
        killed = _KILLED.search(text)
        if killed:
            node, top = _NODE.search(text), _TOP.search(text)
            where = f" on node {node[1]} ({node[2]} GB used of {node[3]} GB)" if node else ""
            largest = f"; the largest process: {top[3]} (pid {top[1]}) at {top[2]} GB" if top else ""
            return f"Ray's memory monitor killed {killed[1]} worker(s){where}{largest}"
        e = e.__cause__ or e.__context__
    return None
