"""The ``(N, τ)`` search as a Ray Tune experiment (``docs/design.md`` §2).

One Tune experiment per predictive, one trial per configuration ``(method, N, τ)``.
:func:`chunk_refs` reads the search split **once** on the driver into fixed-size chunks
(:func:`pipelines.evaluation.chunks.iter_chunks`, Ray Data in order) that go to the object
store; a trial's step ``k`` scores chunk ``k`` and reports the running objective (NLL, or
ECE) of the chunks so far, from the same mergeable accumulators as the hand-made loop
(:class:`pipelines.evaluation.trials.SearchAccumulator`). :class:`SearchTrainable` is a
class trainable run with ``reuse_actors=True``: ``setup`` loads the model and the method's
posterior once per Tune actor (:class:`pipelines.evaluation.actors.ModelActor`), and
``reset_config`` re-targets it to the next trial's ``(N, τ)`` with
``laplace_core.posteriors.build.with_hyper`` (no model or posterior reload). Every trial draws the
same ``θ_t`` from ``(seed, t)`` and an example's prediction does not depend on its batch
neighbours, so a trial's accumulators equal those of the data-parallel loop up to the
order of the float64 sums.

Search algorithms: ``random`` runs :func:`pipelines.evaluation.trials.sample_configs`'s
configurations as a grid of configuration ids (the same configurations and seeds as the
paper's protocol); ``tpe`` asks Optuna's TPE sampler (``ray.tune.search.optuna``) for
``num_configs`` points in each method's ranges, one sampler per method seeded with ``seed``,
all behind one experiment (:class:`pipelines.evaluation.asha.MethodSearcher`: one trial actor
serves every method, as in the random search). Schedulers: ``none``
(every configuration sees the whole split) or ``asha``
(:class:`pipelines.evaluation.asha.PromotionASHA`: promotion-based ASHA within each method,
grace period one chunk, ``reduction_factor``, at most all chunks; paused trials keep their
running sums in Tune's checkpoints).

Failures: a Tune actor that dies is replaced and its trial starts again
(``FailureConfig(max_failures)``); the trial's result does not depend on the attempt.
Experiment state lives under ``<output>/eval/tune/<method>-<key>`` (local or ``s3://``,
through the run's storage options), so a re-submitted job restores an unfinished
experiment (``Tuner.restore``) instead of starting it again, and a finished one
(:data:`DONE_FILE`) is not run again; ``key`` hashes the settings and the split, so a
changed search starts afresh.
"""
from __future__ import annotations

import logging

import hashlib
import json
import math
import os
import tempfile
import time
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from ray import tune
from ray.tune.utils.util import warn_if_slow

# Tune warns when one of its own steps takes over 0.5 s ("... may be a performance bottleneck.
# Please consider reporting results less frequently"): on a busy machine that happens to every
# search, whose steps are whole evaluation chunks, and nothing in it is for the user to act on
# (the demo's log gained 9 such lines at load 20). A TUNE_WARN_THRESHOLD_S the user sets wins.
if "TUNE_WARN_THRESHOLD_S" not in os.environ:
    warn_if_slow.DEFAULT_THRESHOLD = 10.0

from pipelines.errors import DETERMINISTIC, StageError, error_line
from pipelines.evaluation.actors import ModelActor, await_round
from pipelines.evaluation.asha import GridSearcher, MethodSearcher, PromotionASHA, RunningLimiter
from pipelines.evaluation.chunks import iter_chunks, load_chunk, valid_batches
from pipelines.evaluation.runtime import SearchConfig
from pipelines.evaluation.search_progress import SearchProgress
from pipelines.storage import uris as storage
from pipelines.storage.store import RunStore

#: The ``trial`` name of the MAP reference (``"map:0"``).
MAP_TRIAL = "map"
#: Written into a finished experiment's folder with its trials' results: a later call with the
#: same settings returns them without restoring the experiment.
DONE_FILE = "infoform-done.json"

__all__ = ["MAP_TRIAL", "chunk_refs", "tpe_space", "SearchTrainable", "experiment_key", "run_experiment",
           "map_reference"]


# --------------------------------------------------------------------------- data
def chunk_refs(ds: Any, cfg: SearchConfig) -> tuple[list[Any], int, dict[str, Any]]:
    """Read ``ds`` (Ray Dataset of image/label/path/valid rows) once, in order, into chunks of
    ``cfg.batches_per_chunk`` fixed-size batches; put each in the object store as numpy
    arrays (``xs`` ``[batches, batch_size, ...]``, ``ys``, ``sizes``: zero-copy reads).
    Returns ``(refs, images, skipped report dict)``."""
    import ray

    ctx = getattr(ds, "context", None)
    if ctx is not None:  # the same chunks on every submission (ASHA's decisions depend on them)
        ctx.execution_options.preserve_order = True
    t0 = time.perf_counter()
    print(f"[search] reading and decoding the search split{_rows(cfg)} into chunks of up to "
          f"{cfg.batches_per_chunk * cfg.batch_size} images", flush=True)
    it, skipped = valid_batches(ds, cfg.batch_size)
    refs, n = [], 0
    for c in iter_chunks(it, cfg.batch_size, cfg.batches_per_chunk, dtype=cfg.torch_dtype, device="cpu"):
        refs.append(ray.put({"xs": torch.stack(c.xs).numpy(), "ys": torch.cat(c.ys).numpy(),
                             "sizes": np.asarray(c.sizes, dtype=np.int64)}))
        n += c.count
    print(f"[search] {n} images in {len(refs)} chunk(s) read in {time.perf_counter() - t0:.1f} s", flush=True)
    return refs, n, skipped().to_dict()


def _rows(cfg: SearchConfig) -> str:
    n = cfg.expected_rows[0] if cfg.expected_rows else None
    return f" ({n} images)" if n else ""


# --------------------------------------------------------------------------- trainable
class SearchTrainable(tune.Trainable):
    """One configuration of one method per trial; one chunk per ``step``.

    ``config``: ``{"trial": "<method>:<i>"}`` (random: configuration ``i`` of the method's
    ``sample_configs``; ``"map:0"`` scores the MAP reference) or ``{"method": m, "log10_n": a,
    "log10_tau": b}`` (tpe; ``method`` when the config names none). Set up through
    ``tune.with_parameters`` with ``model`` (model ref), ``uris`` (``method -> posterior URI``:
    every posterior is loaded once), ``method``, ``cfg``, ``chunks`` (object refs of
    :func:`chunk_refs`), ``store`` (the run's). Each result: ``objective`` (running NLL or
    ECE; ``inf`` once failed), ``images`` (scored so far), ``acc`` (accumulators as JSON),
    ``status`` / ``reason``, ``seconds``, ``done`` after the last chunk or a failure."""

    def setup(self, config, model=None, uris=None, method=None, cfg=None, chunks=None, store=None):
        self.cfg, self.default_method, self.chunks = cfg, method, list(chunks)
        from pipelines.distributed.cluster import verbose

        if not verbose():  # Tune's per-checkpoint INFO lines stay out of the job's log
            for name in ("ray.train", "ray.tune"):
                logging.getLogger(name).setLevel(logging.WARNING)
        self.error = ""  # a deterministic error: reported as the trial's result, not raised (Tune would retry)
        self.k = self.images = 0
        self.seconds = 0.0
        self.actor = ModelActor(model, dict(uris), None, cfg, store)
        if self.actor.init_error is not None:
            if not self.actor.init_deterministic:  # e.g. the store did not answer: Tune retries the trial
                raise StageError(f"search actor could not start: {self.actor.init_error}")
            self.error = f"search actor could not start: {self.actor.init_error}"
            return
        try:
            self._start(config)
        except DETERMINISTIC as e:
            self.error = error_line(e)

    def reset_config(self, new_config) -> bool:
        self.config = new_config
        if self.actor.init_error is None:
            self.error = ""
            try:
                self._start(new_config)
            except DETERMINISTIC as e:
                self.error = error_line(e)
        return True

    def _start(self, config: Mapping[str, Any]) -> None:
        from laplace_core.posteriors.build import with_hyper

        from pipelines.evaluation.predictors import make_predictor
        from pipelines.evaluation.trials import HyperConfig, SearchAccumulator, sample_configs

        self.acc, self.images, self.seconds = SearchAccumulator.create(self.cfg), 0, 0.0
        self.reason, self.k, self.pred = "", 0, None
        if "trial" in config:
            self.method, cid = str(config["trial"]).split(":")
            if self.method == MAP_TRIAL:
                self.hc = HyperConfig(0, math.nan, math.nan)
                return
            self.hc = sample_configs(self.cfg, self.method)[int(cid)]
        else:
            self.method = str(config.get("method", self.default_method))
            self.hc = HyperConfig(-1, float(config["log10_n"]), float(config["log10_tau"]))
        t0 = time.perf_counter()
        try:
            post = with_hyper(self.actor.posteriors[self.method], self.hc.n_data, self.hc.prior_precision)
            self.pred = make_predictor(self.actor.model, post, self.cfg.pred_type, self.cfg.mc_samples,
                                       self.cfg.seed, 0)
        except ValueError as e:  # precision not positive definite
            self.reason = str(e)
        self.seconds += time.perf_counter() - t0

    def save_checkpoint(self, checkpoint_dir: str) -> dict[str, Any]:
        """The trial's running state (its accumulators are sums: a restored trial goes on)."""
        return {"acc": self.acc.to_json(), "images": self.images, "seconds": self.seconds, "reason": self.reason,
                "k": self.k}

    def load_checkpoint(self, state: dict[str, Any]) -> None:
        from pipelines.evaluation.trials import SearchAccumulator

        self.acc = SearchAccumulator.from_json(state["acc"])
        self.images, self.seconds, self.reason, self.k = state["images"], state["seconds"], state["reason"], state["k"]

    def _fault(self) -> None:
        marker = self.cfg.fault_marker
        if marker and self.k == 1 and not storage.exists(marker):
            storage.write_json_atomic(marker, {"pid": os.getpid(), "time": time.time()})
            print(f"[search] fault injection: trial actor process {os.getpid()} exits", flush=True)
            os._exit(1)

    def step(self) -> dict[str, Any]:
        if not self.error:
            try:
                return self._step()
            except DETERMINISTIC as e:
                self.error = error_line(e)
        hc = getattr(self, "hc", None)
        return {"objective": math.inf, "images": self.images, "chunks": self.k, "seconds": self.seconds,
                "status": "error", "reason": self.error, "error": self.error,
                "log10_n": math.nan if hc is None else hc.log10_n, "log10_tau": math.nan if hc is None else hc.log10_tau,
                "acc": "{}", "done": True}

    def _step(self) -> dict[str, Any]:
        import ray

        from pipelines.evaluation.predictors import finite_or_reason, predict_chunk

        if not self.reason:
            t0 = time.perf_counter()
            chunk = load_chunk(ray.get(self.chunks[self.k]), self.cfg.resolved_device)
            with torch.no_grad():
                p = torch.cat(predict_chunk(self.actor.model, self.pred, chunk))
            y = torch.cat(chunk.ys)
            self.reason = finite_or_reason(p)
            if not self.reason:
                try:
                    self.acc = self.acc.update(p, y)
                    self.images += chunk.count
                except ValueError as e:  # e.g. rows not summing to 1 after overflow
                    self.reason = f"invalid predictions: {e}"
            self.seconds += time.perf_counter() - t0
            self.k += 1
            self._fault()
        failed = bool(self.reason)
        objective = math.inf if failed else float(self.acc.compute()["nll" if self.cfg.objective == "nll" else "ece"])
        return {"objective": objective, "images": self.images, "chunks": self.k, "seconds": self.seconds,
                "status": "failed" if failed else "ok", "reason": self.reason,
                "log10_n": self.hc.log10_n, "log10_tau": self.hc.log10_tau,
                "acc": json.dumps(self.acc.to_json()), "done": failed or self.k >= len(self.chunks)}


# --------------------------------------------------------------------------- experiment
def experiment_key(cfg: SearchConfig, methods: Sequence[str], images: int, extra: str = "") -> str:
    """A short hash of what a method's trials compute (settings, split size, ``extra``: e.g. the
    split's fingerprint); not the actor resources, retries or logging."""
    keep = ("num_configs", "log10_n", "log10_tau", "objective", "mc_samples", "seed", "ece_bins", "ece_mode",
            "configs", "chunk_size", "batch_size", "pred_type", "dtype", "scheduler", "algorithm", "reduction_factor",
            "map_limit_log10_tau")
    d = {k: getattr(cfg, k) for k in keep}
    d.update(methods=list(methods), ranges=[cfg.ranges(m) for m in methods], images=images, extra=extra)
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:12]


def _filesystem(uri: str, store: RunStore):
    """``(pyarrow filesystem or None, path)`` for Tune's ``storage_path``."""
    if not storage.is_remote(uri):
        return None, os.path.abspath(uri)
    from pyarrow.fs import FSSpecHandler, PyFileSystem

    fs, path = store.fs(uri)
    return PyFileSystem(FSSpecHandler(fs)), path


def _space_and_search(cfg: SearchConfig, methods: Sequence[str], max_t: int):
    """``(param_space, search_alg, num_samples, scheduler, max_concurrent_trials)`` of one
    experiment: random runs the MAP reference (in the first of ``cfg.searched_pred_types``'
    experiments only) and every method's configurations as one grid;
    tpe one sampler per method, the methods one after another. With ASHA the searcher is
    wrapped in a :class:`RunningLimiter` (a paused trial frees its slot) instead of Tune's
    concurrency limit."""
    sched = None
    if cfg.scheduler == "asha":
        sched = PromotionASHA(max_t, cfg.reduction_factor, exempt=(MAP_TRIAL,), max_concurrent=cfg.trials_at_once)
    if cfg.algorithm == "random":
        from pipelines.evaluation.trials import sample_configs

        # the MAP reference is the same for every predictive: scored in the first predictive's grid only
        first = cfg.pred_type == cfg.searched_pred_types[0]
        names = [f"{MAP_TRIAL}:0"] * first + [f"{m}:{c.config_id}" for m in methods for c in sample_configs(cfg, m)]
        if sched is None:
            return {"trial": tune.grid_search(names)}, None, 1, None, cfg.trials_at_once
        alg = RunningLimiter(GridSearcher([{"trial": n} for n in names]), cfg.trials_at_once, sched)
        return {}, alg, len(names), sched, None
    try:
        from ray.tune.search.optuna import OptunaSearch
        import optuna
    except ImportError:
        raise StageError("search.algorithm=tpe needs optuna (pip install optuna)") from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # not "A new study created" per method in the job's log
    samplers = {}
    for m in methods:
        space, first = tpe_space(cfg, m)
        samplers[m] = OptunaSearch(OptunaSearch.convert_search_space(space), metric="objective", mode="min",
                                   points_to_evaluate=first, sampler=optuna.samplers.TPESampler(seed=cfg.seed))
    alg, total = MethodSearcher(samplers, cfg.num_configs), cfg.num_configs * len(methods)
    if sched is None:
        return {}, alg, total, None, cfg.trials_at_once
    return {}, RunningLimiter(alg, cfg.trials_at_once, sched), total, sched, None


def tpe_space(cfg: SearchConfig, method: str) -> tuple[dict[str, Any], list[dict[str, float]] | None]:
    """``(Tune space, points to evaluate first)`` of a TPE search of ``method``: its ranges; with
    ``cfg.map_limit_log10_tau`` TPE starts from the MAP-limit configuration and the τ range reaches it."""
    from pipelines.evaluation.trials import map_limit_config

    (n0, n1), (t0, t1) = cfg.ranges(method)
    limit = map_limit_config(cfg, method)
    top = t1 if limit is None else max(t1, limit.log10_tau)
    space = {"log10_n": tune.uniform(n0, n1), "log10_tau": tune.uniform(t0, top)}
    return space, None if limit is None else [{"log10_n": limit.log10_n, "log10_tau": limit.log10_tau}]


def _grid_size(space: Mapping[str, Any]) -> int:
    """Trials per sample of ``space`` (the grid's length; 1 without a grid)."""
    grid = space.get("trial") if isinstance(space, Mapping) else None
    return len(grid["grid_search"]) if isinstance(grid, Mapping) and "grid_search" in grid else 1


def _fit_from(tuner: Any, where: str) -> Any:
    """``tuner.fit()`` with ``where`` as the working directory: Tune lists the experiment's
    files with relative paths (``os.getcwd()``), and a Ray job's working directory can be gone
    by then (seen with a job's ``working_dir`` on a cluster); the previous one is restored."""
    try:
        prev = os.getcwd()
    except FileNotFoundError:
        prev = None
    os.chdir(where)
    try:
        return tuner.fit()
    finally:
        if prev is not None and os.path.isdir(prev):
            os.chdir(prev)


def run_experiment(model: Mapping[str, Any], uris: Mapping[str, str], chunks: Sequence[Any], images: int,
                   cfg: SearchConfig, *, storage_root: str | None = None, key: str = "",
                   store: RunStore = RunStore(), progress_end: bool = True) -> list[dict[str, Any]]:
    """Run (or restore) one Tune experiment over the methods of ``uris`` (random: with the MAP
    reference); returns one dict per trial: ``trial``
    (``"<method>:<i>"``, or ``"<method>:tpe"``), ``trial_id``, ``timestamp`` (of its last
    result), ``pid`` (of the trial actor that reported it) and the last reported result's fields. A trial that still fails after
    ``cfg.max_failures`` retries ends the call with a :class:`pipelines.errors.StageError`;
    the experiment state keeps the finished trials, and the next call with the same settings
    runs only the rest. ``progress_end``: False when the caller runs several experiments and writes
    their total line itself."""
    methods = list(uris)
    tmp = None
    if storage_root is None:
        storage_root = tmp = tempfile.mkdtemp(prefix="tune-")
    fs, path = _filesystem(storage_root, store)
    name = f"{'+'.join(methods)}-{experiment_key(cfg, methods, images, key)}"
    trainable = tune.with_resources(
        tune.with_parameters(SearchTrainable, model=dict(model), uris=dict(uris), method=methods[0], cfg=cfg,
                             chunks=list(chunks), store=store),
        {"cpu": cfg.cpus_per_actor, "gpu": cfg.gpus_per_actor})
    space, alg, num_samples, scheduler, concurrent = _space_and_search(cfg, methods, max(1, len(chunks)))
    exp = f"{path.rstrip('/')}/{name}"
    label = "" if progress_end else f"{'+'.join(methods)}, {cfg.pred_type}"  # one of several experiments
    done_uri = None if tmp is not None else storage.join(storage_root, name, DONE_FILE)
    if done_uri is not None and store.exists(done_uri):  # finished before: nothing runs
        print(f"[search] the Tune experiment at {storage.join(storage_root, name)} is finished; its results are reused",
              flush=True)
        return json.loads(store.read_bytes(done_uri))["trials"]
    no_runtime_env_for_trainables()
    try:
        if tune.Tuner.can_restore(exp, storage_filesystem=fs):
            print(f"[search] resuming the Tune experiment at {storage.join(storage_root, name)}", flush=True)
            tuner = tune.Tuner.restore(exp, trainable, resume_errored=True, param_space=space, storage_filesystem=fs)
        else:
            tuner = tune.Tuner(
                trainable, param_space=space,
                tune_config=tune.TuneConfig(metric="objective", mode="min", search_alg=alg, scheduler=scheduler,
                                            num_samples=num_samples, max_concurrent_trials=concurrent,
                                            reuse_actors=True),
                run_config=tune.RunConfig(name=name, storage_path=path, storage_filesystem=fs, verbose=0,
                                          stop=StopOnError(),
                                          failure_config=tune.FailureConfig(max_failures=cfg.max_failures),
                                          callbacks=[SearchProgress(num_samples * _grid_size(space), images,
                                                                    cfg.log_every_s, progress_end, label)]))
        grid = _fit_from(tuner, tempfile.gettempdir())
        errors = [(r.config, r.metrics["error"]) for r in grid if r.metrics and r.metrics.get("error")]
        if errors:  # deterministic: not retried, and no experiment is left to resume into the same error
            if tmp is None:
                store.remove(storage.join(storage_root, name), recursive=True)
            raise StageError(f"search trial {errors[0][0]} failed: {errors[0][1]} (not retried: it would fail "
                             "the same way again)")
        out = []
        for r in grid:
            if r.error is not None or not r.metrics or "acc" not in r.metrics:
                why = str(r.error).strip().splitlines()[-1][:300] if r.error is not None else "no result"
                raise StageError(f"search trial {r.config} failed: {why}")
            out.append({"trial": r.config.get("trial", f"{r.config.get('method', methods[0])}:tpe"),
                        "trial_id": r.metrics.get("trial_id", ""), "timestamp": r.metrics.get("timestamp"),
                        "pid": r.metrics.get("pid"),
                        **{k: r.metrics[k] for k in ("objective", "images", "chunks", "seconds", "status", "reason",
                                                     "log10_n", "log10_tau", "acc")}})
        if done_uri is not None:  # the commit point of the experiment (Tune would resume paused trials)
            store.write_bytes_atomic(done_uri, json.dumps({"trials": out}).encode())  # NaN: MAP's N, τ
        return out
    finally:
        if tmp is not None:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)


class StopOnError(tune.Stopper):
    """Ends the whole experiment once a trial reports a deterministic error (``error`` in its result)."""

    def __init__(self):
        self.failed = False

    def __call__(self, trial_id: str, result: Mapping[str, Any]) -> bool:
        if result.get("error"):
            self.failed = True
        return bool(result.get("error"))

    def stop_all(self) -> bool:
        return self.failed


def no_runtime_env_for_trainables() -> None:
    """Ray Tune registers every trainable with a runtime env of the driver's Tune and Train
    variables (and ``PL_DISABLE_FORK``): a runtime env that is not empty starts each trial actor
    through Ray's ``setup_worker.py`` (a second Python importing Ray before the worker: ~0.2 CPU-s
    per actor, measured), and it would copy the driver's ``AWS_*`` credentials there,
    which Ray's runtime-env agent writes to its log on each node. The trainables need none of it:
    they run no Ray Train, do not depend on their working directory, read credentials from their
    node's AWS chain like every other worker, and inherit the job's own runtime env (or, on a
    local instance, the driver's environment) as every actor does."""
    from ray.tune.execution import class_cache

    class_cache.DEFAULT_ENV_VARS = {}
    class_cache.ENV_VARS_TO_PROPAGATE = frozenset()


def map_reference(model: Mapping[str, Any], chunks: Sequence[Any], cfg: SearchConfig,
                  store: RunStore = RunStore()) -> dict[str, Any]:
    """The MAP model's accumulators on the search split (JSON), in one Ray task."""
    import ray

    @ray.remote(num_cpus=cfg.cpus_per_actor, num_gpus=cfg.gpus_per_actor)
    def score(model, chunks, cfg, store):
        from pipelines.evaluation.predictors import load_eval_model, predict_chunk
        from pipelines.evaluation.trials import SearchAccumulator

        torch.set_num_threads(cfg.threads)
        net = load_eval_model(model, dtype=cfg.torch_dtype, device=cfg.resolved_device, store=store,
                              precision=cfg.precision)
        acc = SearchAccumulator.create(cfg)
        with torch.no_grad():
            for ref in chunks:
                c = load_chunk(ray.get(ref), cfg.resolved_device)
                acc = acc.update(torch.cat(predict_chunk(net, None, c)), torch.cat(c.ys))
        return acc.to_json()

    return await_round([score.remote(dict(model), list(chunks), cfg, store)], (), cfg, "map reference")[0]
