"""The scheduled-audit checks around a run (docs/scheduled-audits.md): before it, in preflight
(:func:`preflight_schedule`: the alert rules parse, an explicit ``--reuse`` names a finished run
of the same model and weights, the history root is writable); after it (:func:`finish_run`: the
alert rules checked, ``alerts.json`` written, the job's exit code).
"""
from __future__ import annotations

from typing import Any, Callable

from pipelines.cli.alerts import finish, parse_rules
from pipelines.cli.preflight import check_uri, check_writable
from pipelines.cli.reuse import REUSED_STAGES, read_record, run_dir_for, weights_identity
from pipelines.errors import PreflightError
from pipelines.storage import layout

__all__ = ["preflight_schedule", "finish_run"]

_MODES = ("auto", "none")


def preflight_schedule(cfg: Any, *, dry_run: bool = False) -> None:
    """One :class:`PreflightError` line for a bad ``schedule`` setting, before any cluster work."""
    try:
        parse_rules(cfg.schedule.alert)
    except ValueError as e:
        raise PreflightError(str(e)) from None
    mode = cfg.schedule.reuse
    forced = sorted(set(cfg.force) & set(REUSED_STAGES))
    if mode not in _MODES and forced:
        raise PreflightError(f"--reuse {mode} takes the {', '.join(forced)} stage(s) from that run: drop "
                             f"--force {','.join(forced)} or --reuse")
    if dry_run:
        return
    opts = cfg.storage_options()
    if cfg.schedule.history:
        check_writable(cfg.schedule.history, opts)
    if mode not in _MODES:
        for spec in cfg.all_models():
            _check_reused_run(mode, spec, bool(cfg.models), opts)


def _check_reused_run(uri: str, spec: Any, audit: bool, opts: Any) -> None:
    """``--reuse uri`` holds a finished search stage for ``spec``'s model, of the same model name
    and, where both are files, the same weights' bytes (the settings are compared later, once the
    data is listed, still before any cluster work: :func:`pipelines.cli.reuse.plan_reuse`)."""
    run_dir = run_dir_for(uri, spec.name, audit)
    check_uri(layout.stage_marker_uri(run_dir, "search"), f"--reuse {uri}: its finished search stage", opts)
    record = read_record(run_dir, opts)
    if record is None:
        return
    there = record.get("model") or {}
    if there.get("name") != spec.name:
        raise PreflightError(f"--reuse {uri}: a run of model {there.get('name')!r}, this run is of {spec.name!r}")
    if spec.weights is not None and there.get("weights_identity") is not None:
        here = weights_identity(spec.weights, opts)
        if here != there["weights_identity"]:
            raise PreflightError(f"--reuse {uri}: made with other weights ({there.get('weights')}, "
                                 f"{there['weights_identity'][:19]}...) than {spec.weights} ({str(here)[:19]}...)")


def finish_run(cfg: Any, summary: dict[str, Any], output: str, log: Callable[[str], None]) -> int:
    """The alert rules on the finished run: ``alerts.json`` and the exit code (3: a rule fired)."""
    return finish(cfg.schedule.alert, summary, output, cfg.storage_options(), log=log)
