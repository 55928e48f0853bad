"""The weekly RayCronJob is a scheduled audit (docs/scheduled-audits.md), and infra/README.md's
weekly cost with reuse follows from the cost table's own inputs. Offline and fast; the manifests
are read with tests/jobs/test_infra.py's helpers (its parser of entrypoints and cost inputs)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _infra():
    path = ROOT / "tests" / "jobs" / "test_infra.py"
    spec = importlib.util.spec_from_file_location("infoform_test_infra_helpers", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


infra = _infra()


@pytest.mark.parametrize("where_spec", infra.rayjob_specs()[1:], ids=lambda w: w[0].split(":")[0])
def test_weekly_job_reuses_appends_and_alerts(where_spec):
    """Both schedules (the RayCronJob and the CronJob's RayJob): each week's output under the audit
    root, --history on that root, reuse on, the week's own split evaluated, alert rules that parse."""
    from pipelines.cli.alerts import parse_rules

    where, spec = where_spec
    cfg = infra.dry_run(spec["entrypoint"], where)
    root = cfg.schedule.history
    assert root == "s3://YOUR-BUCKET/infoform/audit" and cfg.output.startswith(root + "/")
    assert cfg.schedule.reuse == "auto" and cfg.data.test_split == "weekly/2026-W47"
    rules = parse_rules(cfg.schedule.alert)
    assert {r.metric for r in rules} == {"ece", "accuracy", "ood_auroc"}


def test_there_are_two_weekly_schedules():
    assert [w.split(":")[0] for w, _ in infra.rayjob_specs()[1:]] == ["raycronjob-audit.yaml", "cronjob-submit.yaml"]


def test_weekly_cost_with_reuse_is_the_evaluation_row():
    v = infra.cost_inputs()
    hours = v["K_mc"] * (v["N_ev"] + v["N_ood"]) * v["rho_mc"] / v["r_fwd"] / 3600
    row = infra._table_row("Weekly audit with reuse")
    assert row[1] == f"{int(4 * v['K_mc'] * (v['N_ev'] + v['N_ood'])):,}"
    assert row[3] == f"{hours:.2f}" and row[4] == f"${hours * v['p_gpu']:.2f}"
    assert row[1:] == infra._table_row("Evaluation")[1:]
    text = " ".join(infra.README.read_text().split())
    assert f"every later week with the same weights, curvature data and settings runs the evaluation only, " \
           f"{hours:.2f} A100-hours (${hours * v['p_gpu']:.2f} at p_gpu)" in text
