"""The append-only history of a scheduled audit (issue 41, acceptance 1), no cluster:

* 8 processes append at the same moment (a barrier) into one local root and one root on moto's S3
  server: 6 new runs and 2 re-submissions of runs written before. Afterwards every row of every run
  is there, and each re-submitted run holds its new rows only (the single-file history, read,
  changed and written whole, loses rows here: most writers' rows are overwritten by the last one);
* an older single-file ``history.parquet`` is read as it is, migrated once by the next append (one
  object per run and model, the file removed), and a re-submission of one of its runs replaces
  that run's rows.
"""
from __future__ import annotations

import datetime as dt
import multiprocessing as mp
from types import SimpleNamespace

import pytest

T0 = dt.datetime(2026, 11, 2, 3, 0, tzinfo=dt.timezone.utc)
WRITERS = 8
RESUBMITTED = (0, 1)  # runs written before the race and submitted again inside it


def _summary(run: str, acc: float, model: str = "resnet50") -> dict:
    head = {"status": "ok", "accuracy": acc, "ece": 0.02,
            "intervals": {"n": 100, "n_ood": 0, "ci": {"accuracy": [acc - 0.01, acc + 0.01]}}}
    return {"output": run, "model": {"name": model}, "reused": {}, "results": {"map": head, "inf": dict(head)}}


class _Split(list):
    fingerprint = "fp"


def _splits():
    return SimpleNamespace(test=_Split(range(100)), ood=None)


def _acc(i: int, round_: int) -> float:
    return round(0.5 + i / 100 + round_ / 1000, 6)


def _append(root: str, endpoint: str | None, i: int, round_: int) -> None:
    from pipelines.report.history import append_run
    from pipelines.storage.uris import StorageOptions

    store = StorageOptions(endpoint).resolved() if endpoint else None
    append_run(root, _summary(f"{root}/runs/w{i}", _acc(i, round_)), _splits(), store,
               when=T0 + dt.timedelta(days=i, seconds=round_), log=lambda s: None)


def _writer(barrier, roots: list[tuple[str, str | None]], i: int, round_: int) -> None:
    for root, endpoint in roots:  # every writer starts each root's append at the same moment
        barrier.wait(timeout=60)
        _append(root, endpoint, i, round_)


def _check(root: str, endpoint: str | None) -> None:
    from pipelines.report.history import read_history
    from pipelines.storage.uris import StorageOptions

    store = StorageOptions(endpoint).resolved() if endpoint else None
    rows = read_history(root, store).to_pylist()
    got = sorted((r["run"].rsplit("/", 1)[-1], r["method"], r["accuracy"]) for r in rows)
    # every writer's two rows, and the re-submitted runs' round-1 rows only (no round-0 row left)
    want = sorted((f"w{i}", m, _acc(i, 1)) for i in range(WRITERS) for m in ("map", "inf"))
    assert got == want, root


@pytest.mark.s3
def test_eight_writers_at_once_lose_nothing_locally_and_on_s3(tmp_path, s3_bucket):
    bucket, endpoint = s3_bucket
    roots = [(str(tmp_path / "audit"), None), (f"{bucket}/audit", endpoint)]
    for root, ep in roots:  # runs w0, w1 written before, in round 0
        for i in RESUBMITTED:
            _append(root, ep, i, 0)
    ctx = mp.get_context("forkserver")  # not fork: this process runs moto's server threads
    ctx.set_forkserver_preload(["pipelines.report.history", "s3fs"])  # imported once, not by each writer
    barrier = ctx.Barrier(WRITERS)
    # w0, w1 submitted again (round 1) beside six new runs w2..w7
    procs = [ctx.Process(target=_writer, args=(barrier, roots, i, 1)) for i in range(WRITERS)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0] * WRITERS
    for root, ep in roots:
        _check(root, ep)


def test_a_single_file_history_is_read_then_migrated_once(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipelines.report.history import (HISTORY_FILE, append_run, history_dir, read_history, run_object_uri,
                                          run_rows)

    root = str(tmp_path)
    old = [r | {"retired": "x"} for i in (0, 1) for r in run_rows(_summary(f"runs/w{i}", _acc(i, 0)), _splits(),
                                                                  T0 + dt.timedelta(days=i))]
    pq.write_table(pa.Table.from_pylist(old), tmp_path / HISTORY_FILE)  # an older root, with a retired column
    rows = read_history(root).to_pylist()
    assert [(r["run"], r["method"], r["accuracy"], r["retired"]) for r in rows] == [
        (r["run"], r["method"], r["accuracy"], "x") for r in old]
    lines: list[str] = []
    append_run(root, _summary("runs/w1", _acc(1, 1)), _splits(), when=T0 + dt.timedelta(days=8), log=lines.append)
    assert not (tmp_path / HISTORY_FILE).exists() and any("migrated" in line for line in lines)
    assert (tmp_path / "history").is_dir() and run_object_uri(root, "runs/w0", "resnet50").startswith(history_dir(root))
    rows = read_history(root).to_pylist()
    assert [(r["run"], r["accuracy"]) for r in rows] == [("runs/w0", _acc(0, 0))] * 2 + [("runs/w1", _acc(1, 1))] * 2
    assert [r["retired"] for r in rows] == ["x", "x", None, None]  # the migrated run keeps its column
    lines.clear()
    append_run(root, _summary("runs/w2", _acc(2, 0)), _splits(), when=T0 + dt.timedelta(days=9), log=lines.append)
    assert not any("migrated" in line for line in lines) and len(read_history(root)) == 6
    assert sorted(p.name.split("--")[1] for p in (tmp_path / "history").iterdir()) == ["w0", "w1", "w2"]
