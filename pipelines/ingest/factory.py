"""A user's own model: ``--model package.module:callable`` (:mod:`pipelines.ingest.models` builds
every model; this is the part that imports and calls a user's factory). The module is imported as
usual, and a top-level module that is not found is looked for in the working directory too
(``--model mynet:Net`` beside ``mynet.py``, as ``uvicorn main:app`` finds ``main.py``). Every failure
is a one-line ``ValueError``."""
from __future__ import annotations

import sys
from typing import Callable

from torch import nn

from pipelines.ingest.timm_models import is_timm

__all__ = ["is_factory", "resolve_factory", "build_factory"]


def is_factory(name: str) -> bool:
    """``"package.module:callable"`` (a user's model factory) rather than a registry name."""
    return ":" in name and not is_timm(name)


def resolve_factory(name: str) -> Callable[..., nn.Module]:
    """The callable of ``"package.module:callable"`` (attribute paths ``a.b`` allowed after
    the colon); one-line ``ValueError`` for a malformed string, a module that does not
    import or a missing attribute."""
    mod_name, _, attr = name.partition(":")
    if not mod_name or not attr or ":" in attr:
        raise ValueError(f"model factory {name!r} must look like package.module:callable")
    try:
        obj = _import_here_too(mod_name)
    except Exception as e:  # ImportError, or the module's own error at import time
        raise ValueError(f"model factory {name!r}: cannot import module {mod_name!r} "
                         f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"model factory {name!r}: {mod_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"model factory {name!r}: {attr!r} is not callable")
    return obj


def _import_here_too(mod_name: str):
    """``import mod_name``; a top-level module that is not found is looked for in the working
    directory too (``--model mynet:Net`` beside ``mynet.py``, as ``uvicorn main:app`` does)."""
    import importlib
    import os

    try:
        return importlib.import_module(mod_name)
    except ModuleNotFoundError as e:
        here = os.getcwd()
        if e.name != mod_name.split(".")[0] or here in sys.path:
            raise
        sys.path.append(here)
        return importlib.import_module(mod_name)


def build_factory(name: str, num_classes: int | None) -> nn.Module:
    """The factory's model: ``callable()``, or ``callable(num_classes=...)`` when a count is given."""
    fn = resolve_factory(name)
    try:
        model = fn() if num_classes is None else fn(num_classes=int(num_classes))
    except Exception as e:
        msg = str(e).splitlines()[0] if str(e) else ""
        raise ValueError(f"model factory {name!r} raised {type(e).__name__}: {msg}") from None
    if not isinstance(model, nn.Module):
        raise ValueError(f"model factory {name!r} returned {type(model).__name__}, not a torch.nn.Module")
    return model
