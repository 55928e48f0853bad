"""Using a finished run: ``load_run`` (Python) and ``infoform score`` (Ray Data batch scoring)."""
from pipelines.serve.run_loader import LoadedRun, RunError, RunInfo, load_run, read_run

__all__ = ["LoadedRun", "RunError", "RunInfo", "load_run", "read_run"]
