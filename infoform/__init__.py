"""``import infoform``: the user-facing entry points of a finished run.

``infoform.load_run(uri, storage_options=None)`` loads a run's model, its posteriors at the
chosen ``(N, τ)`` and its transforms (:mod:`pipelines.serve.run_loader`); the command line is
``infoform score`` (:mod:`pipelines.serve.score`).
"""
from pipelines.serve.run_loader import LoadedRun, RunError, load_run

__all__ = ["LoadedRun", "RunError", "load_run"]
