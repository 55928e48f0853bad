"""Two things a reader of the demo's first screen met (the demo's one OOD set, letters, and the
MAP-limit configuration chosen when no posterior beats MAP): a single OOD set's AUROC and AUPR-Out
are not shown a second time beside the pooled OOD AUROC and AUPR (they are the same numbers), and
a method whose choice is the MAP-limit configuration gets no "edge of the search range" note."""
from __future__ import annotations

from pipelines.report.edges import edge_notes
from pipelines.report.verdict import METRICS, metrics_of, shown_metrics


def _results(sets: tuple[str, ...]) -> dict:
    head = {"accuracy": 0.9, "ood_auroc": 0.8}
    for s in sets:
        head.update({f"ood_auroc@{s}": 0.8, f"ood_fpr95@{s}": 0.4, f"ood_aupr_in@{s}": 0.7, f"ood_aupr_out@{s}": 0.6})
    return {"map": dict(head), "inf": dict(head)}


def test_a_single_set_shows_only_what_the_pooled_rows_do_not():
    one = _results(("letters",))
    assert [m.key for m in metrics_of(one)][len(METRICS):] == [
        "ood_auroc@letters", "ood_fpr95@letters", "ood_aupr_in@letters", "ood_aupr_out@letters"]  # history keeps all
    assert [m.key for m in shown_metrics(one)][len(METRICS):] == ["ood_fpr95@letters", "ood_aupr_in@letters"]
    two = _results(("letters", "noise"))
    assert shown_metrics(two) == metrics_of(two) and len(metrics_of(two)) == len(METRICS) + 8


def test_the_map_limit_choice_gets_no_edge_note():
    cfg = {"log10_n": [2.0, 5.0], "log10_tau": [0.0, 4.0], "map_limit_log10_tau": 8.0}
    chosen = {"diag": {"log10_n": 5.0, "log10_tau": 8.0}, "kfac": {"log10_n": 3.0, "log10_tau": 3.99}}
    notes = edge_notes(chosen, cfg)
    assert notes == ["KFAC: the chosen log10 τ = 3.99 is on the upper edge of its search range [0.00, 4.00]; "
                     "the optimum may lie outside: search log10_tau: [0.00, 8.00] to include it"], notes
    assert len(edge_notes(chosen, {k: v for k, v in cfg.items() if k != "map_limit_log10_tau"})) == 3


def test_tpe_draws_tau_up_to_the_map_limit_so_its_edge_is_there():
    """The demo's TPE chose log10 τ = 5.17 inside the τ range it draws from ([0, 8]: up to the MAP
    limit), and the log said it was on the upper edge of [0, 4] and to search [0, 8]."""
    cfg = {"algorithm": "tpe", "log10_n": [2.0, 5.0], "log10_tau": [0.0, 4.0], "map_limit_log10_tau": 8.0}
    assert edge_notes({"diag": {"log10_n": 3.27, "log10_tau": 5.17}}, cfg) == []
    notes = edge_notes({"inf": {"log10_n": 3.27, "log10_tau": 0.1}}, cfg)
    assert notes == ["INF: the chosen log10 τ = 0.10 is on the lower edge of its search range [0.00, 8.00]; "
                     "the optimum may lie outside: search log10_tau: [-8.00, 8.00] to include it"], notes
    assert len(edge_notes({"diag": {"log10_n": 3.27, "log10_tau": 5.17}}, {**cfg, "algorithm": "random"})) == 1
