"""The actor engine of the search and the evaluation (``docs/design.md`` §2).

:func:`run_actors` starts ``cfg.num_actors`` Ray actors of a class, gives actor ``i`` the
``i``-th iterator of ``streaming_split(num_actors, equal=False)`` of every dataset, waits
for them to be placed (:func:`wait_for_actors`: says what is missing, ends after
``cfg.placement_timeout_s``), collects their ``run`` results in actor order and starts
the round again when an actor dies. :class:`ModelActor` is the body both stages' actors
share: it loads the model and every posterior **once**, in ``__init__``, and keeps an
error of that load for ``started()`` (the driver reports it in one line).
:class:`ActorProgress` is the progress log of a round (actor 0 only); :func:`inject_fault`
is the test-only fault of ``RuntimeFields.fault_marker``.
"""
from __future__ import annotations

import os
import time
from typing import Any, Iterable, Iterator, Mapping, Sequence

import torch
from ray import method as ray_method

from pipelines.malloc import tune_malloc
from pipelines.distributed.workers import free_cpus
from pipelines.errors import StageError, cause_line, is_deterministic
from pipelines.evaluation.predictors import load_eval_model, load_posteriors
from pipelines.evaluation.runtime import RuntimeFields
from pipelines.storage import uris as storage
from pipelines.storage.store import RunStore

__all__ = ["ActorProgress", "ModelActor", "inject_fault", "actor_options", "wait_for_actors", "round_size",
           "await_round", "run_actors", "quiet_exit_in_callbacks"]


def quiet_exit_in_callbacks() -> None:
    """In this process, a ``SystemExit`` raised inside a callback Python cannot raise from (a
    weakref or ``__del__`` callback that a garbage collection runs) is dropped without the
    traceback Python prints for it. Ray's SIGTERM handler raises ``SystemExit`` wherever the
    actor is: when Tune ends a trial while a collection runs such a callback, the job's log
    showed "(SearchTrainable pid=...) Traceback ... SystemExit: 1" (1 of 3 demo runs); the
    exit is dropped there either way, this only keeps the noise out. Other such exceptions
    are printed as before."""
    import sys

    previous = sys.unraisablehook

    def hook(unraisable) -> None:
        if isinstance(unraisable.exc_value, SystemExit):
            return
        previous(unraisable)

    if getattr(previous, "__name__", "") != "quiet_exit_hook":
        hook.__name__ = "quiet_exit_hook"
        sys.unraisablehook = hook


class ActorProgress:
    """Progress log of a round of actors, written by actor 0 only: every ``cfg.log_every_s``
    seconds one line with the images done (estimated for all actors as actor 0's count
    times ``num_actors``: the shards are split dynamically), images/s and the ETA when
    ``cfg.expected_rows`` (or ``totals``) gives the split's size (the estimate never exceeds
    it). ``__call__(split, n)`` counts ``n`` units (images, or for the search examples x
    configurations) of ``split`` (0: in-domain or validation, 1: OOD) just processed; the
    rate is over the time since the split's first units started (the previous call, or the
    construction), so a first line after a long start-up is not a burst."""

    def __init__(self, what: str, index: int, cfg: RuntimeFields, splits: Sequence[str] = ("test", "ood"),
                 totals: Sequence[int | None] | None = None, unit: str = "images"):
        self.what, self.on, self.k = what, index == 0, cfg.num_actors
        self.every, self.names, self.unit = cfg.log_every_s, splits, unit
        self.totals = tuple(cfg.expected_rows if totals is None else totals)
        self.done = [0, 0]
        self.t0: list[float | None] = [None, None]  # when the split's first units started
        self.last = self.prev = time.perf_counter()

    def __call__(self, split: int, n: float) -> None:
        now = time.perf_counter()
        if self.t0[split] is None:  # its first units were processed after the previous call
            self.t0[split] = self.prev
        self.prev = now
        self.done[split] += n
        if not self.on or now - self.last < self.every or now <= self.t0[split]:
            return
        self.last = now
        print(self.line(split, now), flush=True)

    def line(self, split: int, now: float) -> str:
        """``[what] split: ~done/total units, rate/s, ETA`` (the estimate capped at the total)."""
        total = self.totals[split] if split < len(self.totals) else None
        est = self.done[split] * self.k
        if total:
            est = min(est, total)
        rate = self.done[split] * self.k / (now - self.t0[split])
        eta = "?" if not total or rate <= 0 else f"{max(total - est, 0) / rate:.0f}s"
        return f"[{self.what}] {self.names[split]}: ~{round(est)}/{total or '?'} {self.unit}, {rate:.1f}/s, ETA {eta}"


class ModelActor:
    """Ray actor body shared by the search and the evaluation (wrapped with ``ray.remote`` by
    :func:`run_actors`): loads the model and the posteriors (re-targeted to ``hyper[method] =
    (N, τ)`` when given) once in ``__init__``, with ``cfg.threads`` torch threads, on
    ``cfg.resolved_device``, in ``cfg.torch_dtype``. Subclasses define ``run``."""

    def __init__(self, model: Mapping[str, Any], posterior_uris: Mapping[str, str],
                 hyper: Mapping[str, Sequence[float]] | None, cfg: RuntimeFields,
                 store: RunStore = RunStore()):
        # an exception here is kept, not raised: Ray would print its traceback from every
        # actor; the driver asks ``started()`` and reports the first one in one line
        self.cfg = cfg
        self.init_error: str | None = None
        self.beats, self.waiting = 0, False  # batches read, and whether it waits for the next: the stall watchdog's view
        self.init_deterministic = False  # a retry would fail the same way (pipelines.errors.DETERMINISTIC)
        try:
            self._load(model, posterior_uris, hyper, cfg, store)
        except Exception as e:  # noqa: BLE001 - reported to the driver, which stops the stage
            self.init_error = f"{type(e).__name__}: {e}"
            self.init_deterministic = is_deterministic(e)

    def started(self) -> str | None:
        """``None`` once the model and posteriors are loaded, else the error, in one line."""
        return self.init_error

    @ray_method(concurrency_group="watch")
    def heartbeat(self) -> tuple[int, bool]:
        """``(batches read, waiting for the next one)``. Runs in its own concurrency group
        (:func:`run_actors`), so it answers while ``run`` is busy."""
        return self.beats, self.waiting

    def watched(self, items: Iterable[Any]) -> Iterator[Any]:
        """``items`` as they come, each one counted for :meth:`heartbeat`; while it waits for
        the next one, :attr:`waiting` is set (the time the consumer spends on an item is work,
        not a stall)."""
        it = iter(items)
        while True:
            self.waiting = True
            try:
                item = next(it)
            except StopIteration:
                return
            finally:
                self.waiting = False
            self.beats += 1
            yield item

    def _load(self, model, posterior_uris, hyper, cfg, store: RunStore) -> None:
        t0 = time.perf_counter()
        torch.set_num_threads(cfg.threads)
        tune_malloc()  # reuse the per-batch buffers instead of page-faulting them in again
        quiet_exit_in_callbacks()
        self.model = load_eval_model(model, dtype=cfg.torch_dtype, device=cfg.resolved_device,
                                     store=store, precision=cfg.precision)
        dev = torch.device(cfg.resolved_device)
        # draws happen where the model runs (the posterior's device, laplace_core.predictive.monte_carlo)
        self.posteriors = {m: p if dev.type == "cpu" else p.to(dev)
                           for m, p in load_posteriors(posterior_uris, hyper, store).items()}
        self.load_seconds = time.perf_counter() - t0


def inject_fault(batches: Iterable[Any], marker: str) -> Iterator[Any]:
    """Test-only fault (``RuntimeFields.fault_marker``): after the first batch, exit the
    process unless ``marker`` exists; write it first, so that a retried round runs clean."""
    for i, b in enumerate(batches):
        yield b
        if i == 0 and not storage.exists(marker):
            storage.write_json_atomic(marker, {"pid": os.getpid(), "time": time.time()})
            print(f"[evaluate] fault injection: actor process {os.getpid()} exits", flush=True)
            os._exit(1)


def actor_options(cfg: RuntimeFields) -> dict[str, Any]:
    """The Ray resources of each actor: ``num_cpus`` / ``num_gpus`` from ``cfg``."""
    return {"num_cpus": cfg.cpus_per_actor, "num_gpus": cfg.gpus_per_actor}


def wait_for_actors(ready: Sequence[Any], cfg: RuntimeFields, what: str) -> None:
    """Return once every actor is placed and constructed (or has died: ``run`` then raises).
    ``ready``: each actor's ``__ray_ready__`` ref, queued before any other call. While some
    wait for resources, print every ``cfg.log_every_s`` seconds what each asks for and what
    the cluster has: an actor that asks for a GPU on a cluster without one (and no autoscaler
    to add one) would otherwise wait silently forever. After ``cfg.placement_timeout_s``
    seconds the wait ends with a :class:`pipelines.errors.StageError` saying the same."""
    import ray

    pending = list(ready)
    t0 = time.perf_counter()
    deadline = t0 + cfg.placement_timeout_s
    while pending:
        wait = max(0.0, min(cfg.log_every_s, deadline - time.perf_counter()))
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=wait)
        if not pending:
            break
        have = {k: v for k, v in ray.cluster_resources().items() if k in ("CPU", "GPU")}
        asks = f"each asks for {actor_options(cfg)}, the cluster has {have}"
        if time.perf_counter() >= deadline:
            raise StageError(f"{what}: {len(pending)} of {len(ready)} actor(s) could not be placed within "
                             f"{cfg.placement_timeout_s:g} s: {asks} (lower evaluate.gpus_per_actor or "
                             "evaluate.cpus_per_actor, add nodes, or raise evaluate.placement_timeout_s)")
        print(f"[{what}] {len(pending)} of {len(ready)} actor(s) not started after "
              f"{time.perf_counter() - t0:.0f} s: {asks} ({_waiting_hint(cfg, have)})", flush=True)


def _waiting_hint(cfg: RuntimeFields, have: dict[str, float]) -> str:
    """What to do about actors still waiting: a GPU or CPU request the cluster cannot meet
    names the setting; a request that fits is only slow to start (a busy machine)."""
    if cfg.gpus_per_actor > have.get("GPU", 0.0):
        return ("on a cluster without GPUs, set evaluate.gpus_per_actor=0" if not have.get("GPU")
                else "lower evaluate.gpus_per_actor or add GPU nodes")
    if cfg.cpus_per_actor > have.get("CPU", 0.0):
        return "lower evaluate.cpus_per_actor or add nodes"
    return "the cluster has room for them: other work is holding its CPUs, or they are still starting"


def round_size(cfg: RuntimeFields, what: str, settle_s: float | None = None) -> int:
    """How many actors a round starts so that the Ray Data decode tasks feeding them keep a
    CPU: ``cfg.num_actors`` when the free CPUs cover them plus one decode task
    (``cfg.decode_cpus``). Otherwise it first waits up to ``settle_s`` (default: 30 s, at
    most ``cfg.stall_timeout_s``) for the resources of
    work that just ended (killed actors, finished trainers) to come back, then starts as
    many as fit beside one decode task (at least one), saying so in one line: actors
    that hold every free CPU would wait forever for data nobody can decode. The results do
    not depend on the number of actors (``pipelines.evaluation.evaluate``)."""
    n, each = cfg.num_actors, cfg.cpus_per_actor
    if each <= 0 or cfg.decode_cpus <= 0:
        return n
    need = n * each + cfg.decode_cpus
    free, total = free_cpus(need, min(30.0, cfg.stall_timeout_s) if settle_s is None else settle_s)
    if free + 1e-9 >= need:
        return n
    fit = max(1, min(n, int((free - cfg.decode_cpus + 1e-9) // each)))
    print(f"[{what}] {free:g} of {total:g} CPUs are free: starting {fit} of {n} actor(s) ({each:g} CPU each) "
          f"so that the decode tasks keep {cfg.decode_cpus:g} CPU", flush=True)
    return fit


def _stall_line(what: str, cfg: RuntimeFields, n: int, waited: float) -> str:
    free, total = free_cpus(0.0, 0.0)
    return (f"{what}: no progress for {waited:.0f} s (evaluate.stall_timeout_s={cfg.stall_timeout_s:g}): "
            f"{n} actor(s) holding {n * cfg.cpus_per_actor:g} CPU wait for their data, whose decode tasks ask "
            f"for {cfg.decode_cpus:g} CPU each; the cluster has {free:g} of {total:g} CPUs free "
            "(other work holds the rest: lower evaluate.cpus_per_actor or data.decode_num_cpus, or add CPUs)")


def await_round(refs: Sequence[Any], actors: Sequence[Any], cfg: RuntimeFields, what: str,
                poll_s: float = 1.0, beat_s: float = 5.0) -> list[Any]:
    """``ray.get(refs)`` in short waits, so the driver's main thread stays interruptible (a
    signal handler, e.g. a test's timeout, runs between them), with a stall watchdog when
    ``actors`` (aligned with ``refs``) are given: every ``beat_s`` seconds the unfinished
    actors' :meth:`ModelActor.heartbeat` s are read; when every one of them has been waiting
    for data, with no batch read, for ``cfg.stall_timeout_s`` seconds, the round ends with a
    :class:`pipelines.errors.StageError` naming what waits for what. A call that failed (its
    actor died, its code raised) raises as soon as it is seen, as a plain ``ray.get`` would."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    pending = list(refs)
    last, moved = None, time.perf_counter()
    next_beat = moved + beat_s
    while pending:
        done, pending = ray.wait(pending, num_returns=len(pending), timeout=poll_s)
        if done:
            ray.get(done)  # an actor that died or raised ends the wait now, as a plain ray.get would
        now = time.perf_counter()
        if not pending or not actors or now < next_beat:
            continue
        next_beat = now + beat_s
        busy = [a for a, r in zip(actors, refs) if r in pending]
        try:
            beats = ray.get([a.heartbeat.remote() for a in busy], timeout=beat_s)
            state = (sum(b for b, _ in beats), all(w for _, w in beats))
        except (GetTimeoutError, RayActorError):
            state = last  # an actor that died shows in ``refs``; one that does not answer shows no progress
        if state is not None and (state != last or not state[1]):  # a batch read, or an actor at work on one
            last, moved = state, now
        elif now - moved >= cfg.stall_timeout_s:
            raise StageError(_stall_line(what, cfg, len(busy), now - moved))
    return ray.get(list(refs))


def run_actors(actor_cls: type, init_args: tuple, datasets: Sequence[Any], cfg: RuntimeFields) -> list[dict[str, Any]]:
    """Start the actors of a round (:func:`round_size`: ``cfg.num_actors``, or fewer when the
    cluster's free CPUs would not also fit the decode tasks) of ``actor_cls(*init_args)``,
    give actor ``i`` the ``i``-th ``streaming_split(k, equal=False)`` iterator of every dataset
    in ``datasets`` (``None`` entries stay ``None``) and return their ``run`` results in actor
    order (:func:`await_round`: interruptible, with the stall watchdog). Actors are killed
    afterwards. When an actor dies (``ray.exceptions.RayActorError``) the whole round starts
    again with new actors and new splits, at most ``cfg.max_failures`` times. An error raised
    by the actors' code (in ``__init__``, reported by ``started()``, or in ``run``) stops the
    round at once as a :class:`pipelines.errors.StageError` carrying the cause's own one-line
    message (which names the URI), not the remote tracebacks."""
    import ray
    from ray.exceptions import RayActorError, RayTaskError

    name = actor_cls.__name__
    watch = {"concurrency_groups": {"watch": 1}} if hasattr(actor_cls, "heartbeat") else {}
    remote_cls = ray.remote(**watch)(actor_cls) if watch else ray.remote(actor_cls)
    remote_cls = remote_cls.options(**actor_options(cfg))
    for attempt in range(cfg.max_failures + 1):
        n = round_size(cfg, name)
        actors = [remote_cls.remote(*init_args) for _ in range(n)]
        # queued before ``run`` (an actor runs its calls in order): resolves once it is constructed;
        # actors with a ``started()`` method report an error of their ``__init__`` through it
        ready = [(a.started if hasattr(actor_cls, "started") else a.__ray_ready__).remote() for a in actors]
        try:
            splits = [None if ds is None else ds.streaming_split(n, equal=False) for ds in datasets]
            refs = [a.run.remote(*[None if s is None else s[i] for s in splits], actor_index=i)
                    for i, a in enumerate(actors)]
            wait_for_actors(ready, cfg, name)
            errors = [e for e in ray.get(ready) if isinstance(e, str)]
            if errors:
                raise StageError(f"{name}: {len(errors)} of {n} actor(s) could not start: {errors[0]}")
            try:
                return await_round(refs, actors if watch else (), cfg, name)
            except RayTaskError as e:  # the actors' own code raised: its message, not the remote traceback
                raise StageError(f"{name} failed: {cause_line(e)}") from None
        except RayActorError as e:
            if attempt == cfg.max_failures:
                raise
            why = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
            print(f"[{actor_cls.__name__}] an actor died ({why}); starting the round again "
                  f"(attempt {attempt + 2} of {cfg.max_failures + 1})", flush=True)
        finally:
            for a in actors:
                ray.kill(a)
    raise AssertionError("unreachable")
