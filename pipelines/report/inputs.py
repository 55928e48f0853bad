"""The report's inputs, checked and normalised: metrics dicts, the search table, the run summary.

Plain data in, plain data out (no figures, no pages): the numbers every other module of
:mod:`pipelines.report` shows come from here. The input formats are described in
:mod:`pipelines.report` (package docstring). A malformed input is one ``ValueError`` line.
"""
from __future__ import annotations

import math
import re
from typing import Any, Iterable, Mapping, Sequence

from pipelines.report.methods import order_methods

STATUS_OK = "ok"
SEARCH_REQUIRED_COLUMNS: tuple[str, ...] = ("method", "log10_n", "log10_tau")
#: objective column -> (label, higher is better)
SEARCH_OBJECTIVES: dict[str, tuple[str, bool]] = {
    "nll": ("NLL", False), "accuracy": ("accuracy", True), "ece": ("ECE", False), "brier": ("Brier", False),
}
STAGE_ORDER: tuple[str, ...] = ("data", "curvature", "eigen", "posterior", "search", "evaluate", "report")
BYTES_PER_NUMBER = 4
MB = 2**20
ECE_KEY = re.compile(r"^ece_(equal_width|equal_mass)_(\d+)$")


# --------------------------------------------------------------------------- metrics
def split_failed(metrics_by_method: Mapping[str, Any], prefix: str = "") -> tuple[dict[str, Any], list[str]]:
    """``(ok, failed)``: the methods whose ``metrics.json`` has no ``status`` or ``status == "ok"``,
    and one ``"<prefix><method>: <status> (<reason>)"`` line per method whose evaluation did not
    finish (it has no numbers to show; the report lists it instead of failing)."""
    if not isinstance(metrics_by_method, Mapping):
        raise ValueError(f"metrics_by_method must be a mapping, got {type(metrics_by_method).__name__}")
    ok: dict[str, Any] = {}
    failed: list[str] = []
    for meth, d in metrics_by_method.items():
        if isinstance(d, Mapping) and d.get("status", STATUS_OK) != STATUS_OK:
            failed.append(f"{prefix}{meth}: {d.get('status')} ({d.get('reason') or 'no reason given'})")
        else:
            ok[meth] = d
    return ok, failed


def check_metrics(metrics_by_method: Any, allow_empty: bool = False) -> dict[str, Mapping[str, Any]]:
    """The metrics dicts in method order, each checked to be a ``MetricSuite.compute()`` dict."""
    if not isinstance(metrics_by_method, Mapping) or (not metrics_by_method and not allow_empty):
        raise ValueError("metrics_by_method must be a non-empty mapping {method: MetricSuite.compute() dict}")
    out = {}
    for name in order_methods(metrics_by_method):
        m = metrics_by_method[name]
        if not isinstance(name, str) or not name:
            raise ValueError(f"method names must be non-empty strings, got {name!r}")
        if not isinstance(m, Mapping):
            raise ValueError(f"metrics for method {name!r} must be a dict, got {type(m).__name__}")
        for key in ("accuracy", "nll", "brier"):
            if key not in m:
                raise ValueError(f"metrics for method {name!r} lack {key!r} (not a MetricSuite.compute() dict)")
        out[name] = m
    return out


def ece_variants(metrics: Mapping[str, Any]) -> list[tuple[str, str, int]]:
    """``[(key, strategy, n_bins)]`` for the ECE entries of one metrics dict, equal width first.

    >>> ece_variants({"ece_equal_width_15": 0.1, "ece_equal_mass_15": 0.2})
    [('ece_equal_width_15', 'equal_width', 15), ('ece_equal_mass_15', 'equal_mass', 15)]
    """
    found = []
    for key in metrics:
        mt = ECE_KEY.match(str(key))
        if mt:
            found.append((key, mt.group(1), int(mt.group(2))))
    return sorted(found, key=lambda t: (t[1] != "equal_width", t[2]))


def variant_label(strategy: str, n_bins: int) -> str:
    """E.g. ``"equal width, 15 bins"``."""
    return f"{strategy.replace('_', ' ')}, {n_bins} bins"


def pick_variant(metrics_by_method: Mapping[str, Mapping[str, Any]], variant: str | None) -> tuple[str, str, int]:
    """The reliability variant shared by all methods: ``(suffix, strategy, n_bins)``."""
    if variant is not None:
        mt = ECE_KEY.match("ece_" + variant)
        if not mt:
            raise ValueError(f"unknown ECE variant {variant!r}; expected e.g. 'equal_width_15' or 'equal_mass_15'")
        missing = [m for m, d in metrics_by_method.items() if "reliability_" + variant not in d]
        if missing:
            raise ValueError(f"reliability_{variant} missing for method(s) {missing}")
        return variant, mt.group(1), int(mt.group(2))
    common = None
    for d in metrics_by_method.values():
        keys = {k[len("ece_"):] for k, _, _ in ece_variants(d) if "reliability_" + k[len("ece_"):] in d}
        common = keys if common is None else common & keys
    if not common:
        raise ValueError("no reliability_<variant> bin table shared by all methods (e.g. reliability_equal_width_15)")
    first = next(iter(sorted(common, key=lambda s: (not s.startswith("equal_width"), s))))
    mt = ECE_KEY.match("ece_" + first)
    return first, mt.group(1), int(mt.group(2))


def is_finite(x: Any) -> bool:
    """A real (non-bool) finite number."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


# --------------------------------------------------------------------------- derived numbers
def reliability_points(metrics: Mapping[str, Any], variant: str = "equal_width_15") -> list[dict[str, float]]:
    """Non-empty bins of ``metrics["reliability_<variant>"]`` as dicts with ``lo``, ``hi``,
    ``count``, ``confidence`` (mean confidence), ``accuracy`` and ``gap = confidence - accuracy``
    (the Maddox et al. y-axis; > 0 means over-confident)."""
    key = "reliability_" + variant
    if key not in metrics:
        raise ValueError(f"metrics lack {key!r}; present: {sorted(k for k in metrics if k.startswith('reliability_'))}")
    pts = []
    for b in metrics[key]:
        if not b.get("count"):
            continue
        conf, acc = float(b["confidence"]), float(b["accuracy"])
        lo = b.get("lo")
        hi = b.get("hi")
        pts.append({"lo": float(lo) if lo is not None else conf, "hi": float(hi) if hi is not None else conf,
                    "count": int(b["count"]), "confidence": conf, "accuracy": acc, "gap": conf - acc})
    return pts


def _hist_mean(hist: Mapping[str, Sequence[float]]) -> float | None:
    edges, counts = list(hist["edges"]), list(hist["counts"])
    total = sum(counts)
    if total == 0:
        return None
    return sum(c * 0.5 * (edges[i] + edges[i + 1]) for i, c in enumerate(counts)) / total


def ood_entropy_means(metrics: Mapping[str, Any]) -> tuple[float | None, float | None, bool]:
    """``(mean in, mean out, out_is_estimate)``: the in-distribution mean normalised entropy
    (exact, ``entropy_mean``) and the OOD mean: ``ood["entropy_mean_out"]`` when present, else
    the mean of the OOD histogram at bin centres (``out_is_estimate = True``; the error is at most
    half a bin width, 0.01 at the default 50 bins). ``None`` when there is no OOD data."""
    mean_in = metrics.get("entropy_mean")
    ood = metrics.get("ood")
    if not isinstance(ood, Mapping):
        return mean_in, None, False
    if is_finite(ood.get("entropy_mean_out")):
        return mean_in, float(ood["entropy_mean_out"]), False
    hist = ood.get("entropy_hist_out")
    if not isinstance(hist, Mapping):
        return mean_in, None, False
    return mean_in, _hist_mean(hist), True


# --------------------------------------------------------------------------- search table
def search_rows(table: Any) -> list[dict[str, Any]]:
    """The search table as a list of row dicts (pandas DataFrame, pyarrow Table, list of dicts
    or dict of columns). Raises ``ValueError`` when a required column is missing."""
    if table is None:
        return []
    if hasattr(table, "to_dict") and hasattr(table, "columns") and not isinstance(table, Mapping):  # pandas
        rows = table.to_dict("records")
        cols = [str(c) for c in table.columns]
    elif hasattr(table, "to_pylist") and hasattr(table, "column_names"):  # pyarrow
        rows = table.to_pylist()
        cols = list(table.column_names)
    elif isinstance(table, Mapping):
        cols = list(table)
        lengths = {len(v) for v in table.values()}
        if len(lengths) > 1:
            raise ValueError(f"search table columns have different lengths: {sorted(lengths)}")
        n = lengths.pop() if lengths else 0
        rows = [{c: table[c][i] for c in cols} for i in range(n)]
    elif isinstance(table, Sequence) and not isinstance(table, (str, bytes)):
        rows = [dict(r) for r in table]
        cols = sorted({c for r in rows for c in r})
    else:
        raise ValueError(f"search table must be a DataFrame, pyarrow Table, list of dicts or dict of columns, "
                         f"got {type(table).__name__}")
    if rows:
        missing = [c for c in SEARCH_REQUIRED_COLUMNS if c not in cols]
        if missing:
            raise ValueError(f"search table lacks column(s) {missing}; has {cols}")
    out = []
    for r in rows:
        r = dict(r)
        for c in ("log10_n", "log10_tau", *[k for k in cols if objective_info(k)]):
            v = r.get(c)
            r[c] = float(v) if v is not None and _is_number(v) else None
        r["method"] = str(r["method"])
        status = r.get("status")
        r["status"] = STATUS_OK if status is None and "status" not in cols else str(status)
        out.append(r)
    return out


def objective_info(col: str) -> tuple[str, bool] | None:
    """``(label, higher is better)`` for an objective column: ``nll``, ``accuracy``, ``ece``,
    ``brier`` or a named ECE variant such as ``ece_equal_width_15``; None for other columns."""
    if col in SEARCH_OBJECTIVES:
        return SEARCH_OBJECTIVES[col]
    mt = ECE_KEY.match(col)
    return (f"ECE ({variant_label(mt.group(1), int(mt.group(2)))})", False) if mt else None


def _is_number(v: Any) -> bool:
    try:
        return math.isfinite(float(v))
    except (TypeError, ValueError):
        return False


def failed_row(row: Mapping[str, Any]) -> bool:
    """Whether a search row is a configuration that was not evaluated."""
    return row.get("status") != STATUS_OK


def scored(rows: list[dict]) -> bool:
    """Whether any search row carries an objective value (failed configurations have none)."""
    return any(r.get(c) is not None for r in rows for c in SEARCH_OBJECTIVES)


def chosen_point(chosen: Mapping[str, Any] | None, method: str) -> tuple[float, float] | None:
    if not chosen or method not in chosen:
        return None
    c = chosen[method]
    if isinstance(c, Mapping):
        if "log10_n" in c and "log10_tau" in c:
            return float(c["log10_n"]), float(c["log10_tau"])
        if "n" in c and "tau" in c:
            return math.log10(float(c["n"])), math.log10(float(c["tau"]))
        raise ValueError(f"chosen[{method!r}] needs log10_n/log10_tau or n/tau, got keys {sorted(c)}")
    if isinstance(c, Sequence) and len(c) == 2:
        return float(c[0]), float(c[1])
    raise ValueError(f"chosen[{method!r}] must be a dict or a (log10_n, log10_tau) pair, got {c!r}")


# --------------------------------------------------------------------------- run summary
def opt_mapping(summary: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    """``summary[key]``, a mapping or absent (``{}``)."""
    v = summary.get(key)
    if v is None:
        return {}
    if not isinstance(v, Mapping):
        raise ValueError(f"run_summary[{key!r}] must be a mapping, got {type(v).__name__}")
    return v


def count_with_parts(summary: Mapping[str, Any], key: str) -> tuple[int | None, dict[str, int]]:
    """An int, or a mapping of parts (summed); None when absent."""
    v = summary.get(key)
    if v is None:
        return None, {}
    if isinstance(v, bool) or not isinstance(v, (int, Mapping)):
        raise ValueError(f"run_summary[{key!r}] must be an int or a mapping of ints, got {type(v).__name__}")
    if isinstance(v, int):
        return v, {}
    parts = {}
    for k, x in v.items():
        if isinstance(x, bool) or not isinstance(x, int):
            raise ValueError(f"run_summary[{key!r}][{k!r}] must be an int, got {x!r}")
        parts[str(k)] = x
    return sum(parts.values()), parts


def skipped_images(summary: Mapping[str, Any]) -> tuple[int | None, list[tuple[str, str]]]:
    """``(total, [(path, reason)])`` of ``skipped_images``, the parts summed, repeated examples once."""
    v = summary.get("skipped_images")
    if v is None:
        return None, []
    if isinstance(v, int) and not isinstance(v, bool):
        return v, []
    if not isinstance(v, Mapping):
        raise ValueError(f"run_summary['skipped_images'] must be an int or a mapping, got {type(v).__name__}")
    parts = [v] if "count" in v else list(v.values())
    total, examples = 0, []
    for p in parts:
        if not isinstance(p, Mapping) or "count" not in p:
            raise ValueError("run_summary['skipped_images'] needs {'count', 'examples'} (or a mapping of those)")
        total += int(p["count"])
        for e in p.get("examples", ()):
            if isinstance(e, Mapping):
                examples.append((str(e.get("path", "")), str(e.get("reason", ""))))
            else:
                examples.append((str(e), ""))
    return total, list(dict.fromkeys(examples))


def failed_configs(summary: Mapping[str, Any], rows: list[dict[str, Any]]) -> tuple[int | None, list[dict]]:
    """``(count, failed rows)``: from ``failed_search_configs`` when given, else from the search rows."""
    v = summary.get("failed_search_configs")
    failed_rows = [r for r in rows if failed_row(r)]
    if v is None:
        return (len(failed_rows) if rows else None), failed_rows
    if isinstance(v, int) and not isinstance(v, bool):
        return v, failed_rows
    if isinstance(v, Sequence) and not isinstance(v, (str, bytes)):
        return len(v), [dict(r) for r in v]
    raise ValueError(f"run_summary['failed_search_configs'] must be an int or a list, got {type(v).__name__}")


def posterior_sizes(summary: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """``{method: {"numbers", "mb", "note"}}``; MB computed at :data:`BYTES_PER_NUMBER` when not given."""
    out = {}
    for meth, s in opt_mapping(summary, "posterior_sizes").items():
        if isinstance(s, (int, float)) and not isinstance(s, bool):
            s = {"numbers": int(s)}
        if not isinstance(s, Mapping):
            raise ValueError(f"run_summary['posterior_sizes'][{meth!r}] must be a dict with 'numbers'/'mb'")
        num = s.get("numbers")
        mb = s.get("mb")
        if mb is None and is_finite(num):
            mb = num * BYTES_PER_NUMBER / MB
        out[str(meth)] = {"numbers": num, "mb": mb, "note": s.get("note") or ""}
    return out


def model_name(summary: Mapping[str, Any]) -> str:
    m = summary.get("model")
    if isinstance(m, Mapping):
        return str(m.get("name") or m.get("arch") or "model")
    return str(m) if m else "model"


def order_stages(stages: Iterable[str]) -> list[str]:
    """Known stages in :data:`STAGE_ORDER`, then the others alphabetically."""
    stages = list(dict.fromkeys(stages))
    return [s for s in STAGE_ORDER if s in stages] + sorted(s for s in stages if s not in STAGE_ORDER)


def shows_predictive(summary: Mapping[str, Any], mbm: Mapping[str, Mapping[str, Any]]) -> bool:
    """A "Predictive" column when the search chose among several (``search.pred_types``) or a row is not ``nn``."""
    srch = summary.get("search") if isinstance(summary.get("search"), Mapping) else {}
    info = srch.get("info") if isinstance(srch.get("info"), Mapping) else {}
    return len(info.get("pred_types") or ()) > 1 or any(d.get("pred_type") == "glm" for d in mbm.values())


def timings_and_chosen(summary: Mapping[str, Any]) -> tuple[Mapping[str, Any], list[str], Mapping[str, Any]]:
    """``(method -> stage -> seconds, the stages in order, method -> chosen (N, τ))`` of a run summary."""
    mt = opt_mapping(summary, "method_timings")
    for k, v in mt.items():
        if not isinstance(v, Mapping):
            raise ValueError(f"run_summary['method_timings'][{k!r}] must be a mapping stage -> seconds")
    stages = order_stages({s for v in mt.values() for s in v})
    chosen = summary.get("chosen") or {}
    if not isinstance(chosen, Mapping):
        raise ValueError("run_summary['chosen'] must be a mapping method -> (log10_n, log10_tau)")
    return mt, stages, chosen


def temperature_line(temp: Any) -> str:
    """The run summary's temperature fit as one line under the verdict: the fallback line when the
    row fell back to ``T = 1``, else the fit's note (e.g. T set by few mistakes), else ``""``."""
    if not isinstance(temp, Mapping):
        return ""
    if temp.get("fallback"):
        return str(temp["fallback"])
    if temp.get("note") and is_finite(temp.get("temperature")):
        return f"Temperature scaling (T = {temp['temperature']:.3g}, fit on the search split): {temp['note']}."
    return ""


#: MAP is "near chance" when its test accuracy is less than this fraction of the way from chance
#: (``1/C``) to 100%: seen as a new user, a resnet18 trained at 64 px and scored at 224 px got 30% on
#: 4 classes, and the report read its posteriors' rows without a word about it.
NEAR_CHANCE = 0.25


def chance_line(summary: Mapping[str, Any]) -> str:
    """One line when MAP's test accuracy is near chance (:data:`NEAR_CHANCE`), naming what to check;
    else ``""``. Every posterior is centred at MAP, so its rows inherit what MAP gets wrong."""
    m = (summary.get("results") or {}).get("map")
    classes = (summary.get("data") or {}).get("num_classes")
    if not isinstance(m, Mapping) or not is_finite(m.get("accuracy")) or not isinstance(classes, int) or classes < 2:
        return ""
    chance = 1.0 / classes
    if m["accuracy"] >= chance + NEAR_CHANCE * (1.0 - chance):
        return ""
    n = f" of the {m['count']:,} test images" if isinstance(m.get("count"), int) else ""
    return (f"MAP classifies {m['accuracy']:.1%}{n} correctly, near chance ({classes} classes: {chance:.1%}): check "
            "that the weights, the class folders, the image size and the normalisation match how the network was "
            "trained; every posterior here is centred at MAP and inherits its mistakes.")
