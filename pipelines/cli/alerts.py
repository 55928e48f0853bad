"""Alert rules of a scheduled audit (``--alert 'ece>0.05,accuracy<0.70,inf.ood_auroc<0.8'``,
``schedule.alert``; docs/scheduled-audits.md).

A rule is ``[METHOD.]METRIC OP NUMBER`` with ``OP`` one of ``>``, ``<``, ``>=``, ``<=`` and
``METRIC`` a headline metric of the report (:data:`pipelines.report.verdict.METRICS`), or a per-OOD-set
one as ``ood_auroc@letters`` / ``ood_fpr95@far`` (a set's name or a group; issue 39). Without a
method it is checked for every evaluated method that has the metric (and every model of an audit).
The rules are parsed in preflight (:func:`parse_rules`: a malformed rule or an unknown metric is one
line, exit 2, naming the valid metrics). After the evaluation, :func:`finish` writes
``<output>/alerts.json`` (every rule, the ones that fired with the value, its 95% interval and
``n``), logs one line per fired rule and gives the job's exit code: 3 when a rule fired, else 0.
"""
from __future__ import annotations

import datetime as _dt
import operator
import re
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Sequence

from pipelines.report.oodsets import SET_BASES
from pipelines.storage import uris as storage

__all__ = ["ALERT_EXIT_CODE", "Rule", "metric_names", "parse_rules", "check_rules", "finish", "alerts_uri"]

#: The job's exit code when a rule fired (0: none did; 1: a stage failed; 2: bad input).
ALERT_EXIT_CODE = 3
_OPS = {">": operator.gt, "<": operator.lt, ">=": operator.ge, "<=": operator.le}
_RULE = re.compile(r"^(?:(?P<method>[A-Za-z_]\w*)\.)?(?P<metric>[A-Za-z_]\w*(?:@[A-Za-z0-9][\w-]*)?)\s*"
                   r"(?P<op>>=|<=|>|<)\s*"
                   r"(?P<num>[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)$")


def metric_names() -> list[str]:
    """The metrics a rule may name: the report's headline metrics."""
    from pipelines.report.verdict import METRICS

    return [m.key for m in METRICS]


def _method_names() -> list[str]:
    from laplace_core.posteriors.methods import method_names

    return ["map", *method_names()]


@dataclass(frozen=True)
class Rule:
    """One parsed rule; :meth:`fires` compares a value with the threshold."""

    text: str
    method: str | None
    metric: str
    op: str
    threshold: float

    def fires(self, value: float) -> bool:
        return bool(_OPS[self.op](value, self.threshold))


def parse_rules(rules: Sequence[str]) -> list[Rule]:
    """The rules of ``schedule.alert``; ``ValueError`` (one line) for the first bad one."""
    valid, methods, out = metric_names(), _method_names(), []
    for raw in rules:
        text = "".join(str(raw).split())
        m = _RULE.match(text)
        where = f"--alert (schedule.alert) {raw!r}"
        if m is None:
            raise ValueError(f"{where}: not a rule; write METRIC>NUMBER or METRIC<NUMBER (also >=, <=; "
                             f"METHOD.METRIC for one method), e.g. ece>0.05; metrics: {', '.join(valid)}")
        base, at, _ = m["metric"].partition("@")
        if at and base not in SET_BASES:
            raise ValueError(f"{where}: {base!r} is not a per-OOD-set metric; valid before @SET or @GROUP: "
                             f"{', '.join(SET_BASES)}")
        if not at and m["metric"] not in valid:
            raise ValueError(f"{where}: unknown metric {m['metric']!r}; valid: {', '.join(valid)}")
        if m["method"] is not None and m["method"] not in methods:
            raise ValueError(f"{where}: unknown method {m['method']!r}; valid: {', '.join(methods)}")
        out.append(Rule(text, m["method"], m["metric"], m["op"], float(m["num"])))
    return out


def _interval(head: Mapping[str, Any], metric: str) -> tuple[list[float] | None, int | None]:
    iv = head.get("intervals") if isinstance(head.get("intervals"), Mapping) else {}
    ci = (iv.get("ci") or {}).get(metric)
    n = iv.get("n_ood") if metric.startswith("ood_") and iv.get("n_ood") else iv.get("n")
    if "@" in metric:  # one OOD set's images, or its group's
        n = _set_count(head, metric.partition("@")[2]) or n
    return (list(ci) if isinstance(ci, (list, tuple)) and len(ci) == 2 else None), n


def _set_count(head: Mapping[str, Any], where: str) -> int | None:
    from pipelines.report.oodsets import per_set_of

    per = per_set_of(head) or {}
    sets = per.get("sets") or {}
    names = (per.get("groups") or {}).get(where, {}).get("sets") or [where]
    got = [sets[n].get("n_out") for n in names if isinstance(sets.get(n), Mapping)]
    return sum(got) if got and all(isinstance(x, int) for x in got) else None


def check_rules(rules: Sequence[Rule], results: Mapping[str, Any], model: str | None = None) -> Iterator[dict]:
    """One entry per (rule, method) checked on ``results`` (``{method: headline}``), fired or not."""
    for rule in rules:
        for method, head in (results or {}).items():
            if rule.method not in (None, method) or not isinstance(head, Mapping):
                continue
            value = head.get(rule.metric)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
                continue
            ci, n = _interval(head, rule.metric)
            yield {"rule": rule.text, "model": model, "method": method, "metric": rule.metric, "op": rule.op,
                   "threshold": rule.threshold, "value": float(value), "ci": ci, "n": n,
                   "fired": rule.fires(float(value))}


def alert_line(entry: Mapping[str, Any]) -> str:
    """``alert: ece>0.05 fired for inf: ece = 0.0621 [0.0493, 0.0755], n = 100``."""
    ci = entry.get("ci")
    ci_text = f" [{ci[0]:.4g}, {ci[1]:.4g}]" if ci else " (no interval)"
    who = f"{entry['model']}/{entry['method']}" if entry.get("model") else entry["method"]
    n = f", n = {entry['n']}" if entry.get("n") is not None else ""
    return f"alert: {entry['rule']} fired for {who}: {entry['metric']} = {entry['value']:.4g}{ci_text}{n}"


def alerts_uri(output: str) -> str:
    return storage.join(output, "alerts.json")


def _results_by_model(summary: Mapping[str, Any]) -> dict[str | None, Mapping[str, Any]]:
    """``{None: results}`` for one model, ``{model: results}`` for an audit's listing."""
    if isinstance(summary.get("models"), Mapping):
        return {name: (m or {}).get("results") or {} for name, m in summary["models"].items()}
    return {None: summary.get("results") or {}}


def finish(rules_text: Sequence[str], summary: Mapping[str, Any], output: str, store: Any = None,
           log=print) -> int:
    """Check the rules on a finished run's summary, write ``alerts.json``, log each fired rule;
    returns :data:`ALERT_EXIT_CODE` when one fired, else 0 (no rules: nothing written)."""
    if not rules_text:
        return 0
    rules = parse_rules(rules_text)
    checked = [e for model, res in _results_by_model(summary).items() for e in check_rules(rules, res, model)]
    fired = [e for e in checked if e["fired"]]
    unchecked = sorted({r.text for r in rules} - {e["rule"] for e in checked})
    doc = {"output": output, "checked_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
           "rules": [r.text for r in rules], "fired": fired, "checked": len(checked), "unchecked": unchecked}
    storage.write_json_atomic(alerts_uri(output), doc, store)
    for e in fired:
        log(alert_line(e))
    for text in unchecked:
        log(f"alert: {text} not checked: no evaluated method has that metric")
    if fired:
        log(f"alert: {len(fired)} rule check(s) fired ({alerts_uri(output)}); exit code {ALERT_EXIT_CODE}")
        return ALERT_EXIT_CODE
    log(f"alert: no rule fired ({len(checked)} check(s), {alerts_uri(output)})")
    return 0
