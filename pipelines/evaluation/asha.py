"""Promotion-based ASHA for the ``(N, τ)`` search: a Ray Tune scheduler and the searchers it needs.

ASHA (Li et al. 2020, "A System for Massively Parallel Hyperparameter Tuning", Algorithm 2)
with grace period ``1`` step (one chunk of the search split) and reduction factor ``η``:
rung ``k`` sits at step ``η^k`` (every rung below ``max_t``, the number of chunks). A trial
that reaches rung ``k`` records its running objective there; it goes on only while it is
among the best ``⌊n_k / η⌋`` of the ``n_k`` trials recorded in that rung and has not been
promoted from it before. Otherwise it is **paused** (Tune saves its running sums), and may
be promoted later, when more trials have reached the rung. A free slot goes to a pending
configuration first (the searcher's), then to a paused trial that has become promotable
(highest rung first); once every configuration has started and no trial runs, the paused
trials that are still not promotable are stopped: their rows are "stopped" with the images
they saw. A method none of whose trials has scored the whole split by then (its top rung
held fewer than ``η`` trials) first promotes the best trial of its highest rung, so that
every method has at least one complete configuration to choose.

Why not Ray's ``ASHAScheduler``: it stops a trial whose value is below an interpolated
percentile of the values recorded so far, and continues it otherwise, so the first trials
of a search, which meet almost empty rungs, run the whole split whatever their value (on
the demo data: 6 of 24 configurations per method ran to the end, 0.31 of the full search's
image-samples). With ``⌊n_k / η⌋`` nobody is promoted from a rung with fewer than ``η``
entries, as in the paper.

Trials are grouped (``group(trial)``: ``config["method"]`` (TPE, :class:`MethodSearcher`) or the
method of ``config["trial"] = "<method>:<i>"`` (random)); configurations compete within their group;
``exempt`` groups (the MAP reference) always go on. ``max_concurrent`` trials run at once;
:class:`RunningLimiter` (the searcher side) counts paused trials as not running, so a
paused trial frees its slot for the next configuration. :class:`GridSearcher` hands out a
fixed list of configurations in order (the random search's grid); :class:`MethodSearcher` puts
one searcher per method (TPE's) behind one experiment.
"""
from __future__ import annotations

import json
import math
import os
from typing import Any, Callable, Mapping, Sequence

from ray.tune.experiment import Trial
from ray.tune.schedulers import FIFOScheduler, TrialScheduler
from ray.tune.search import ConcurrencyLimiter, Searcher

__all__ = ["rung_steps", "method_group", "PromotionASHA", "RunningLimiter", "GridSearcher", "MethodSearcher"]


def rung_steps(max_t: int, eta: int) -> list[int]:
    """Steps of the rungs: ``1, η, η², ...`` below ``max_t`` (integer powers: no log rounding)."""
    steps, s = [], 1
    while s < max_t:
        steps.append(s)
        s *= eta
    return steps


def method_group(trial: Trial) -> str:
    """``config["method"]`` (TPE), else ``"<method>"`` of ``config["trial"] = "<method>:<i>"``;
    ``""`` when there is neither."""
    if "method" in trial.config:
        return str(trial.config["method"])
    return str(trial.config.get("trial", "")).split(":")[0]


def _value(v: Any) -> float:
    v = float(v) if v is not None else math.inf
    return math.inf if math.isnan(v) else v


class PromotionASHA(FIFOScheduler):
    """Promotion-based ASHA on ``metric`` (minimised), per group of trials (module docstring)."""

    def __init__(self, max_t: int, reduction_factor: int, *, metric: str = "objective",
                 group: Callable[[Trial], str] = method_group, exempt: Sequence[str] = (), max_concurrent: int = 1):
        super().__init__()
        if reduction_factor < 2:
            raise ValueError(f"reduction_factor must be >= 2, got {reduction_factor}")
        self.eta, self.max_t, self.metric_name = int(reduction_factor), int(max_t), metric
        self.steps = rung_steps(self.max_t, self.eta)
        self.group, self.exempt, self.max_concurrent = group, frozenset(exempt), int(max_concurrent)
        self.rungs: dict[str, list[dict[str, float]]] = {}
        self.promoted: dict[str, list[set[str]]] = {}
        self.paused: set[str] = set()
        self.trials: dict[str, Trial] = {}
        self.finished: dict[str, int] = {}  # per group: trials that scored the whole split
        self.num_stopped = 0

    # ------------------------------------------------------------------ rungs
    def _rung(self, g: str) -> tuple[list[dict[str, float]], list[set[str]]]:
        if g not in self.rungs:
            self.rungs[g] = [{} for _ in self.steps]
            self.promoted[g] = [set() for _ in self.steps]
        return self.rungs[g], self.promoted[g]

    def promotable(self, g: str, k: int, tid: str) -> bool:
        """``tid`` is among the best ``⌊n_k/η⌋`` of rung ``k`` of group ``g`` and not promoted
        from it yet (ties: the trial created first)."""
        rec, prom = self.rungs[g][k], self.promoted[g][k]
        top = len(rec) // self.eta
        if top == 0 or tid in prom or tid not in rec:
            return False
        order = sorted(rec, key=lambda t: (rec[t], t))
        return tid in order[:top]

    def _record(self, trial: Trial, result: Mapping[str, Any]) -> int | None:
        """Record ``result`` in its rung; the rung's index, or None off the rungs."""
        step = int(result.get("training_iteration", 0) or 0)
        if step not in self.steps:
            return None
        k = self.steps.index(step)
        rungs, _ = self._rung(self.group(trial))
        rungs[k][trial.trial_id] = _value(result.get(self.metric_name))
        return k

    # ------------------------------------------------------------------ Tune hooks
    def on_trial_add(self, tune_controller, trial: Trial) -> None:
        self.trials[trial.trial_id] = trial
        if trial.last_result and self.group(trial) not in self.exempt:  # restored experiment: its last rung entry
            if self._record(trial, trial.last_result) is not None and trial.status == Trial.PAUSED:
                self.paused.add(trial.trial_id)

    def on_trial_result(self, tune_controller, trial: Trial, result: dict) -> str:
        g = self.group(trial)
        if g in self.exempt or result.get("done") or int(result.get("training_iteration", 0) or 0) >= self.max_t:
            return TrialScheduler.CONTINUE
        k = self._record(trial, result)
        if k is None:
            return TrialScheduler.CONTINUE
        if self.promotable(g, k, trial.trial_id):
            self.promoted[g][k].add(trial.trial_id)
            return TrialScheduler.CONTINUE
        self.paused.add(trial.trial_id)
        return TrialScheduler.PAUSE

    def on_trial_complete(self, tune_controller, trial: Trial, result: dict) -> None:
        self.paused.discard(trial.trial_id)
        if result and int(result.get("training_iteration", 0) or 0) >= self.max_t:
            g = self.group(trial)
            self.finished[g] = self.finished.get(g, 0) + 1

    def on_trial_remove(self, tune_controller, trial: Trial) -> None:
        self.paused.discard(trial.trial_id)

    def on_trial_error(self, tune_controller, trial: Trial) -> None:
        self.paused.discard(trial.trial_id)

    def _next_promotion(self) -> Trial | None:
        for k in reversed(range(len(self.steps))):  # highest rung first
            for g in self.rungs:
                for tid in sorted(self.rungs[g][k], key=lambda t: (self.rungs[g][k][t], t)):
                    t = self.trials.get(tid)
                    if tid in self.paused and t is not None and t.status == Trial.PAUSED and self.promotable(g, k, tid):
                        return t
        return None

    def _fallback(self) -> Trial | None:
        """A group none of whose trials has scored the whole split (fewer trials in its top
        rung than ``η``): the best paused trial of its highest non-empty rung."""
        for g, rungs in self.rungs.items():
            if self.finished.get(g, 0) or g in self.exempt:
                continue
            for k in reversed(range(len(self.steps))):
                cands = [t for t in sorted(rungs[k], key=lambda t: (rungs[k][t], t)) if t in self.paused
                         and math.isfinite(rungs[k][t]) and self.trials[t].status == Trial.PAUSED]
                if cands:
                    return self.trials[cands[0]]
        return None

    def choose_trial_to_run(self, tune_controller) -> Trial | None:
        trials = tune_controller.get_trials()
        for t in trials:
            if t.status == Trial.PENDING:
                return t
        if sum(t.status == Trial.RUNNING for t in trials) >= self.max_concurrent:
            return None
        search = getattr(tune_controller, "search_alg", None)
        ending = not any(t.status == Trial.RUNNING for t in trials) and (search is None or search.is_finished())
        t = self._next_promotion() or (self._fallback() if ending else None)
        if t is not None:
            g = self.group(t)
            k = max(i for i in range(len(self.steps)) if t.trial_id in self.rungs[g][i])
            self.promoted[g][k].add(t.trial_id)
            self.paused.discard(t.trial_id)
            return t
        if ending:
            for t in trials:  # every configuration has started and nobody can be promoted: the rest lost
                if t.status == Trial.PAUSED:
                    self.paused.discard(t.trial_id)
                    self.num_stopped += 1
                    tune_controller.stop_trial(t)
        return None

    def debug_string(self) -> str:
        return f"PromotionASHA(eta={self.eta}, rungs at {self.steps}, {len(self.paused)} paused)"


class RunningLimiter(ConcurrencyLimiter):
    """At most ``max_concurrent`` trials **running**: unlike ``ConcurrencyLimiter``, the trials
    ``scheduler`` has paused do not count, so their slots go to new configurations."""

    def __init__(self, searcher: Searcher, max_concurrent: int, scheduler: PromotionASHA):
        super().__init__(searcher, max_concurrent)
        self.scheduler = scheduler

    def suggest(self, trial_id: str) -> dict | None:
        if len(self.live_trials - self.scheduler.paused) >= self.max_concurrent:
            return None
        suggestion = self.searcher.suggest(trial_id)
        if suggestion not in (None, Searcher.FINISHED):
            self.live_trials.add(trial_id)
            self.num_unfinished_live_trials += 1
        return suggestion


class GridSearcher(Searcher):
    """The configurations ``configs`` (dicts), in order, one per trial; then finished."""

    def __init__(self, configs: Sequence[Mapping[str, Any]], metric: str = "objective", mode: str = "min"):
        super().__init__(metric=metric, mode=mode)
        self.configs, self.next = [dict(c) for c in configs], 0

    def suggest(self, trial_id: str) -> dict | None:
        if self.next >= len(self.configs):
            return Searcher.FINISHED
        self.next += 1
        return dict(self.configs[self.next - 1])

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        pass

    def save(self, checkpoint_path: str) -> None:
        with open(checkpoint_path, "w") as f:
            json.dump({"configs": self.configs, "next": self.next}, f)

    def restore(self, checkpoint_path: str) -> None:
        with open(checkpoint_path) as f:
            state = json.load(f)
        self.configs, self.next = state["configs"], state["next"]


class MethodSearcher(Searcher):
    """One searcher per method behind one Tune experiment (TPE: an Optuna sampler each, seeded
    alike): the first ``per_method`` trials are the first method's, the next ``per_method`` the
    second's, and so on; each suggestion carries ``"method"``, and a trial's results reach its
    own method's searcher only, so each sampler sees what it would see in an experiment of its
    own (the same proposals). One experiment keeps one trial actor per slot for every method
    (``reuse_actors``): one experiment per method started a new actor process for each."""

    def __init__(self, searchers: Mapping[str, Searcher], per_method: int, metric: str = "objective",
                 mode: str = "min"):
        super().__init__(metric=metric, mode=mode)
        self.searchers, self.per_method = dict(searchers), int(per_method)
        self.given, self.owner = 0, {}

    def suggest(self, trial_id: str) -> dict | None:
        methods = list(self.searchers)
        if self.given >= self.per_method * len(methods):
            return Searcher.FINISHED
        method = methods[self.given // self.per_method]
        got = self.searchers[method].suggest(trial_id)
        if got is None or got == Searcher.FINISHED:
            return got
        self.given += 1
        self.owner[trial_id] = method
        return {**got, "method": method}

    def on_trial_result(self, trial_id: str, result: dict) -> None:
        if trial_id in self.owner:
            self.searchers[self.owner[trial_id]].on_trial_result(trial_id, result)

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        if trial_id in self.owner:
            self.searchers[self.owner[trial_id]].on_trial_complete(trial_id, result, error)

    def _method_path(self, checkpoint_path: str, method: str) -> str:
        """Where method ``method``'s searcher keeps its own state, beside this one's file."""
        return os.path.join(os.path.dirname(checkpoint_path), f"method-searcher-{method}.state")

    def save(self, checkpoint_path: str) -> None:
        """This searcher's own state as JSON (``given``, ``owner``); each method's searcher saves
        its own beside it (Optuna's study and sampler: Ray's ``OptunaSearch.save``)."""
        for method, searcher in self.searchers.items():
            searcher.save(self._method_path(checkpoint_path, method))
        with open(checkpoint_path, "w") as f:
            json.dump({"given": self.given, "owner": self.owner, "methods": list(self.searchers)}, f)

    def restore(self, checkpoint_path: str) -> None:
        with open(checkpoint_path) as f:
            state = json.load(f)
        if state["methods"] != list(self.searchers):
            raise ValueError(f"searcher state of methods {state['methods']}, not {list(self.searchers)}")
        self.given, self.owner = int(state["given"]), dict(state["owner"])
        for method, searcher in self.searchers.items():
            searcher.restore(self._method_path(checkpoint_path, method))
