"""Which failures are worth a retry: a lost worker or node is; an error of the code or the
input (a ``ValueError``-class exception: a bad weights file, a key that does not exist, a
shape that does not fit) is not: it would fail the same way again.

:class:`DeterministicFirst` is Ray Train V2's default failure policy (``FailureConfig``'s
``max_failures`` for worker-group failures, preemptions counted apart) except that a worker
group failure in which any worker raised a deterministic exception ends the run at its first
occurrence. :class:`Trainer` is ``TorchTrainer`` with that policy; its ``fit`` turns a failed
run into a :class:`pipelines.errors.StageError` whose message is one line: the run's name and
the cause (``ValueError: ...``, which names the key or URI).
"""
from __future__ import annotations

from typing import Any

from ray.train.torch import TorchTrainer
from ray.train.v2._internal.execution.failure_handling import DefaultFailurePolicy
from ray.train.v2._internal.execution.failure_handling.failure_policy import FailureDecision
from ray.train.v2.api.exceptions import TrainingFailedError, WorkerGroupError

from pipelines.errors import DETERMINISTIC, StageError, cause_line, error_line, is_deterministic, root_error

__all__ = ["DETERMINISTIC", "is_deterministic", "error_line", "worker_cause", "DeterministicFirst", "Trainer"]


def _lost(failure: BaseException) -> bool:
    """A worker process that died (directly, or seen by the health check), not an error of its code."""
    from ray.exceptions import RayActorError

    return isinstance(failure, RayActorError) or isinstance(getattr(failure, "health_check_failure", None),
                                                            RayActorError)


def worker_cause(error: BaseException) -> tuple[int | None, BaseException | None]:
    """``(rank, exception)`` of the first deterministic worker failure in a Ray Train error, else
    ``(None, None)``; also ``(None, None)`` when a worker was lost (died, failed its health check),
    since the other workers' errors may then be collateral."""
    failures: dict[int, Any] = getattr(error, "worker_failures", None) or {}
    if any(_lost(f) for f in failures.values()):
        return None, None  # a worker was lost (not an error of its code): the others' errors may follow from it
    for rank in sorted(failures):
        if is_deterministic(failures[rank]):
            return rank, root_error(failures[rank])
    return None, None


class DeterministicFirst(DefaultFailurePolicy):
    """Ray Train's default policy, but a deterministic worker error is raised at once."""

    def make_decision(self, training_failed_error: TrainingFailedError) -> FailureDecision:
        if isinstance(training_failed_error, WorkerGroupError) and worker_cause(training_failed_error)[1] is not None:
            return FailureDecision.RAISE
        return super().make_decision(training_failed_error)


class Trainer(TorchTrainer):
    """``TorchTrainer`` with :class:`DeterministicFirst`; a failed run is one :class:`StageError` line."""

    def _initialize_and_run_controller(self, **controller_init_kwargs) -> Any:
        controller_init_kwargs["failure_policy"] = DeterministicFirst(self.run_config.failure_config)
        return super()._initialize_and_run_controller(**controller_init_kwargs)

    def fit(self) -> Any:
        try:
            return super().fit()
        except TrainingFailedError as e:
            rank, cause = worker_cause(e)
            name = self.run_config.name or "Ray Train run"
            if cause is not None:
                raise StageError(f"{name} failed on worker {rank}: {error_line(cause)} (not retried: "
                                 "the same input would fail again)") from None
            failures = getattr(e, "worker_failures", None) or {}
            first = root_error(next(iter(failures.values()), e))
            why = cause_line(first).splitlines()[0] if isinstance(first, TrainingFailedError) else error_line(first)
            raise StageError(f"{name} failed after {self.run_config.failure_config.max_failures} retr(ies) "
                             f"(lost workers are retried): {why[:400]}") from None
