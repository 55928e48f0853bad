"""The partitioned-pass engine: one pass over fixed data partitions on Ray Train workers.

A pass *kind* (:class:`PassKind`) says what is summed: zero sums, ``collect(state, batches)``,
the flat (packed) tensors that are all-reduced, and their checkpoint form. The engine does
the rest, the same way for pass 1 (KFAC factors + Fisher diagonal), the EFB pass and the
subnet Fisher pass:

* **Plan**: rank 0 loads the newest valid checkpoint of the pass (:mod:`.checkpoint`), every
  rank learns its finished partitions, the others are computed in order; each partition's
  data pipeline is opened while the previous one computes (its first batch is fetched in a
  background thread), the first one before the model load.
* **Local accumulation**: every worker adds its shard of every partition into one local
  state; rank 0's state starts from the checkpoint's running sum, the others' from zero.
* **Reduce per interval**: when ``checkpoint_every_s`` has passed since the last reduce (one
  decision for all ranks: a MAX all-reduce of one flag per partition), and once at the end,
  the states are SUM-all-reduced in buckets (every rank then holds the running sum of every
  finished partition), the counts, rows and skip reports of the partitions since the last
  reduce are reduced with them, and a partition whose rows read differ from its size is an
  error. Rank 0 then commits one checkpoint (the running sum, the finished ids, counts and
  skip reports; the older checkpoint is removed after the commit); the other ranks zero
  their state. ``checkpoint_every_s = 0``: after every partition.
* **Records** (per rank): reduces, all-reduce calls and payload bytes, bytes written,
  seconds in compute, data wait, reduce and write, the partitions computed and reused.

Statistics are sums, so the reduced running sum of ``W`` workers equals the single-process
sum over the same images up to round-off, whatever the reduce schedule.
"""
from __future__ import annotations

import gc
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch

from .checkpoint import load_checkpoint, save_checkpoint
from pipelines.malloc import release_free_memory, release_object_store_pages
from .comm import allreduce_sum, broadcast_object, new_comm_record
from .progress import Progress, say
from .workers import Job, path_keys

__all__ = ["PassKind", "PassResult", "PassRun", "dataset_name", "new_pass_record"]


def dataset_name(kind_name: str, pid: int) -> str:
    """The Ray Train dataset name of partition ``pid`` in pass ``kind_name``."""
    return f"{kind_name}_{pid}"


class PassKind:
    """What one pass sums. The default state is a list of tensors that *are* the flat sums
    (subclasses that keep another layout override :meth:`flatten`, :meth:`unflatten`,
    :meth:`clear`).

    ``name``: record key, dataset prefix and checkpoint folder; ``pass_no``: for logs and
    :class:`~pipelines.distributed.workers.FaultInjection`; ``fmt``: the checkpoint's format
    tag; ``count_names``: the integer counts ``collect`` returns (summed over ranks and
    partitions); ``final_checkpoint``: also checkpoint the finished pass (``False`` when the
    caller writes the pass's own artifact right after); ``tag``: log prefix."""

    name: str = "pass"
    pass_no: int = 0
    fmt: str = "infoform.pass_checkpoint"
    count_names: tuple[str, ...] = ("count",)
    final_checkpoint: bool = True
    tag: str = "curvature"

    def zero(self, device) -> Any:
        raise NotImplementedError

    def collect(self, state: Any, batches: Iterator) -> Sequence[int]:
        """Add the sums over ``batches`` (``(x, y, keys)``) into ``state``; return the counts."""
        raise NotImplementedError

    def flatten(self, state: Any) -> list[torch.Tensor]:
        return list(state)

    def unflatten(self, state: Any, flat: Sequence[torch.Tensor]) -> None:
        for s, f in zip(state, flat):
            s.copy_(f)

    def clear(self, state: Any) -> None:
        for s in state:
            s.zero_()

    def to_tensors(self, flat: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        """The checkpoint's tensors (names of the kind's choosing) of the flat sums."""
        return {f"t{i:04d}": t for i, t in enumerate(flat)}

    def from_tensors(self, tensors: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        return [tensors[f"t{i:04d}"] for i in range(len(tensors))]


def new_pass_record() -> dict[str, Any]:
    return {**new_comm_record(), "reduces": 0, "control_allreduce_calls": 0, "bytes_written": 0, "checkpoints": 0,
            "compute_s": 0.0, "data_wait_s": 0.0, "data_start_s": 0.0, "reduce_s": 0.0, "write_s": 0.0,
            "wall_s": 0.0, "images": 0, "invalid": 0, "computed": [], "reused": [], "resumed_from": None,
            "source_bytes": 0, "gc_freed": 0}


class _Counter:
    """Rows read, valid rows, batches, data-wait seconds and the skip report of one worker in one partition."""

    def __init__(self):
        from pipelines.ingest.batches import SkipReport

        self.rows = 0
        self.valid = 0
        self.batches = 0
        self.wait_s = 0.0
        self.first_wait_s: float | None = None
        self.skipped = SkipReport()


class _FirstBatch:
    """A partition's batch generator whose first batch is fetched in a background thread, so
    Ray Data's start-up for the partition overlaps the previous partition's compute. ``get()``
    returns ``(first_batch_or_None, generator)`` and re-raises an error of the fetch."""

    def __init__(self, batches: Iterator):
        self._batches = batches
        self._first = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="first-batch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._first = next(self._batches, None)
        except BaseException as e:  # re-raised by get()
            self._error = e

    def get(self):
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._first, self._batches


@dataclass
class _Totals:
    """Running totals of the finished partitions, the same on every rank after a reduce."""

    done: list[int] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    rows: dict[int, int] = field(default_factory=dict)
    invalid: dict[int, int] = field(default_factory=dict)
    skipped: Any = None

    @classmethod
    def from_meta(cls, meta: dict | None, count_names: Sequence[str]) -> "_Totals":
        from pipelines.ingest.batches import SkipReport

        meta = meta or {}
        return cls(done=[int(p) for p in meta.get("done", [])],
                   counts={k: int(meta.get("counts", {}).get(k, 0)) for k in count_names},
                   rows={int(k): int(v) for k, v in meta.get("rows", {}).items()},
                   invalid={int(k): int(v) for k, v in meta.get("invalid", {}).items()},
                   skipped=SkipReport.from_dict(meta["skipped"]) if "skipped" in meta else SkipReport())

    def to_meta(self) -> dict[str, Any]:
        return {"done": list(self.done), "counts": dict(self.counts),
                "rows": {str(k): v for k, v in self.rows.items()},
                "invalid": {str(k): v for k, v in self.invalid.items()}, "skipped": self.skipped.to_dict()}


@dataclass
class PassResult:
    """The finished pass: ``state`` holds the reduced sums of every partition (on every rank),
    ``counts`` the summed counts, ``rows`` / ``invalid`` the rows read and undecodable rows,
    ``skipped`` the skip report, ``record`` this rank's record (:func:`new_pass_record`)."""

    state: Any
    counts: dict[str, int]
    rows: int
    invalid: int
    skipped: Any
    record: dict[str, Any]

    def info(self) -> dict[str, Any]:
        return {"rows": self.rows, "skipped": self.skipped.to_dict()}


class PassRun:
    """One pass of ``kind`` over ``job.passes[kind.name]`` on this worker.

    ``start()`` (a collective: every rank calls it at the same point) finds the checkpoint to
    resume from and opens the first partition to compute; ``run(...)`` computes the rest and
    returns a :class:`PassResult`."""

    def __init__(self, kind: PassKind, job: Job, rank: int, world: int, device, base_uri: str):
        self.kind, self.job, self.rank, self.world, self.device = kind, job, rank, world, device
        self.base_uri = base_uri
        self.ids = list(job.passes.get(kind.name, ()))
        self.rec = new_pass_record()
        self._started = False
        self.opened: dict[int, tuple[_Counter, _FirstBatch]] = {}

    # ------------------------------------------------------------------ plan
    def start(self) -> "PassRun":
        if self._started:
            return self
        self._started = True
        k, job = self.kind, self.job
        found = None
        if self.rank == 0:
            found = load_checkpoint(self.base_uri, job.fingerprint, job.store, k.fmt, k.tag)
        meta = broadcast_object(None if found is None else {"uri": found[0], **found[1]}, self.rank)
        self._ckpt_tensors = found[2] if found is not None else None
        self.totals = _Totals.from_meta(meta, k.count_names)
        self.final_in_ckpt = bool(meta and meta.get("final"))
        done = set(self.totals.done)
        self.rec["reused"] = [p for p in self.ids if p in done]
        self.rec["resumed_from"] = meta["uri"] if meta else None
        self.todo = [p for p in self.ids if p not in done]
        known = [job.rows.get(p) for p in self.todo]
        total = sum(known) if self.todo and all(r is not None for r in known) else None
        self.progress = Progress(f"pass {k.pass_no} ({getattr(k, 'title', k.name)})", total, self.world, self.rank,
                                 job.cfg.log_every_s, prefix=k.tag)
        if self.todo:
            self._open(self.todo[0])
        return self

    def _sources(self) -> dict:
        """The index partitions and the decode settings (:func:`.workers.put_sources`), fetched once."""
        if getattr(self, "_src", None) is None:
            import ray
            import ray.data

            self._src = ray.get(self.job.sources) if self.job.sources is not None else {"shares": {}}
            ray.data.DataContext.get_current().enable_progress_bars = False  # the engine logs progress
        return self._src

    def _open(self, pid: int) -> None:
        import ray.train

        from pipelines.ingest.batches import build_dataset
        from .workers import fetch_share

        src = self._sources()
        if pid in src["shares"]:  # this rank's share only, fetched and made a dataset now (nothing before)
            share, nbytes = fetch_share(src, pid, self.rank, self.world)
            self.rec["source_bytes"] += nbytes
            shard = iter(()) if share is None else build_dataset(share, src["data_config"])
            counter = _Counter()
            self.opened[pid] = (counter, _FirstBatch(self._batches(shard, pid, counter)))
            return
        name = dataset_name(self.kind.name, pid)
        try:
            shard = ray.train.get_dataset_shard(name)
        except (KeyError, ValueError):
            shard = None
        if shard is None:
            raise RuntimeError(f"{self.kind.name}: partition {pid} is to be computed but this run has no dataset for "
                               "it (the checkpoint the driver saw was passed over); re-submit the job")
        counter = _Counter()
        self.opened[pid] = (counter, _FirstBatch(self._batches(shard, pid, counter)))

    def _batches(self, shard, pid: int, counter: _Counter):
        """``(x, y, keys)`` of the shard's valid rows on the device in the model dtype; counts
        rows and skips; the test-only fault injection point."""
        from pipelines.ingest.batches import iter_valid_batches
        from .workers import DTYPES

        job, rank, pass_no = self.job, self.rank, self.kind.pass_no
        fi = job.cfg.fault_injection
        dtype = DTYPES[job.cfg.model_dtype]
        it = iter_valid_batches(shard, batch_size=job.cfg.batch_size, device=self.device)
        while True:
            t0 = time.perf_counter()
            b = next(it, None)
            dt = time.perf_counter() - t0
            counter.wait_s += dt
            if counter.first_wait_s is None:
                counter.first_wait_s = dt
            if b is None:
                return
            n = int(b.y.shape[0]) + b.skipped.count
            counter.rows += n
            if b.skipped.count:
                counter.skipped = counter.skipped.merge(b.skipped)
            if b.y.shape[0] == 0:
                self.progress(n)
                continue
            counter.valid += int(b.y.shape[0])
            counter.batches += 1
            yield b.x.to(dtype=dtype), b.y, path_keys(b.paths).to(b.y.device)
            self.progress(n)
            if (fi is not None and fi.pass_no == pass_no and fi.partition == pid and fi.rank in (None, rank)
                    and counter.batches >= fi.after_batches):
                if not job.store.exists(fi.once_marker):
                    job.store.write_json_atomic(fi.once_marker, {"pass": pass_no, "partition": pid, "rank": rank,
                                                                 "time": time.time()})
                    say(f"[{self.kind.tag}] fault injection: rank {rank} exits in pass {pass_no} partition {pid}")
                    os._exit(1)

    # ------------------------------------------------------------------ run
    def run(self, every_s: float | None) -> PassResult:
        """Compute every unfinished partition, reducing and checkpointing every ``every_s``
        seconds (``0``: after each partition; ``None``: only at the end)."""
        self.start()
        k, rec, rank = self.kind, self.rec, self.rank
        t_pass = time.perf_counter()
        self.progress.restart(t_pass)
        state = k.zero(self.device)
        if self._ckpt_tensors is not None:  # rank 0 carries the running sum of the checkpoint
            k.unflatten(state, [t.to(self.device) for t in k.from_tensors(self._ckpt_tensors)])
            self._ckpt_tensors = None
        if rank == 0 and self.todo:
            n, r = len(self.todo), len(rec["reused"])
            say(f"[{k.tag}] {self.progress.label}: {n} partition{'s' if n != 1 else ''} to compute"
                + (f", {r} done earlier (checkpoint {rec['resumed_from']})" if r else ""))
        if self.todo:
            self.progress.start_ticker()
        seg: list[int] = []
        counters: dict[int, _Counter] = {}
        local = [0] * len(k.count_names)
        last = time.perf_counter()
        for i, pid in enumerate(self.todo):
            counters[pid], counts = self._compute(i, pid, state)
            # the partition's Ray Data executor, stats and block refs are reference cycles that outlive
            # it until a full collection, which 370k live objects make rare: ~80 pinned blocks and
            # ~0.4 MiB of heap a partition, growing the worker by ~1.5 MiB a partition (issue 29)
            rec["gc_freed"] += gc.collect()
            release_free_memory()  # and the free pages its batches left in the heap, which grew it by ~2 MiB a partition
            release_object_store_pages()  # this partition's blocks' pages: the store's, not this worker's
            local = [a + int(b) for a, b in zip(local, counts)]
            seg.append(pid)
            final = i == len(self.todo) - 1
            if not self._due(final, every_s, last):
                continue
            flat = self._reduce(state, seg, counters, local, keep=final)
            if rank == 0 and (not final or k.final_checkpoint):
                self._checkpoint(flat, final)
            del flat
            seg, counters, local, last = [], {}, [0] * len(k.count_names), time.perf_counter()
        if not self.todo:  # resumed from a finished pass: every rank still needs the sums
            self._reduce(state, [], {}, local, keep=True)
        else:
            self.progress.finish(sum(self.totals.rows.get(p, 0) for p in self.todo))
        rec["wall_s"] = time.perf_counter() - t_pass
        release_free_memory()  # the batches' freed buffers: not kept under what the stage does next
        t = self.totals
        return PassResult(state=state, counts=dict(t.counts), rows=sum(t.rows.values()),
                          invalid=sum(t.invalid.values()), skipped=t.skipped, record=rec)

    def _compute(self, i: int, pid: int, state) -> tuple["_Counter", Sequence[int]]:
        """Collect partition ``pid`` (the ``i``-th to compute) into ``state``, the next one's data
        pipeline opened meanwhile; returns its counter and the counts it added (zeros without data)."""
        k, rec = self.kind, self.rec
        counter, pre = self.opened.pop(pid)
        t0 = time.perf_counter()
        first, batches = pre.get()
        blocked = time.perf_counter() - t0
        counter.wait_s += blocked - (counter.first_wait_s or 0.0)  # what the loop waited, not the thread
        counter.first_wait_s = blocked
        if i + 1 < len(self.todo):  # the next partition's pipeline starts while this one computes
            self._open(self.todo[i + 1])
        counts: Sequence[int] = [0] * len(k.count_names)
        if first is not None:
            def chain(first=first, batches=batches):
                yield first
                yield from batches

            counts = k.collect(state, chain())
        rec["compute_s"] += time.perf_counter() - t0 - counter.wait_s
        rec["data_wait_s"] += counter.wait_s
        rec["data_start_s"] += counter.first_wait_s or 0.0
        return counter, counts

    def _due(self, final: bool, every_s: float | None, last: float) -> bool:
        """Whether to reduce (and checkpoint) now: after the last partition, after each with
        ``every_s <= 0``, never before the end with ``None``; else once ``every_s`` seconds passed
        since ``last`` on any rank (one all-reduced decision for every rank)."""
        import torch.distributed as dist

        if final or (every_s is not None and every_s <= 0):
            return True
        if every_s is None:
            return False
        flag = torch.tensor([float(time.perf_counter() - last >= every_s)], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self.rec["control_allreduce_calls"] += 1
        return bool(flag.item())

    def _reduce(self, state, seg: list[int], counters: dict, local: list[int], keep: bool):
        """SUM-all-reduce the states (every rank then holds the running sum), the counts, rows and
        skip reports of ``seg``; check rows; ranks other than 0 zero their state unless ``keep``.
        Returns the reduced flat tensors (views, valid until the state changes)."""
        import torch.distributed as dist

        k, job, rec = self.kind, self.job, self.rec
        t0 = time.perf_counter()
        comm = new_comm_record()
        reduced = allreduce_sum(k.flatten(state), int(job.cfg.bucket_mb * 2**20), comm)
        k.unflatten(state, reduced)
        for key in comm:
            rec[key] += comm[key]
        rec["reduces"] += 1
        nums = torch.tensor([*local, *[counters[p].rows for p in seg], *[counters[p].skipped.count for p in seg]],
                            dtype=torch.float64, device=self.device)
        dist.all_reduce(nums, op=dist.ReduceOp.SUM)
        rec["control_allreduce_calls"] += 1
        nums = [int(round(float(v))) for v in nums.cpu()]
        nc = len(k.count_names)
        rows = dict(zip(seg, nums[nc:nc + len(seg)]))
        invalid = dict(zip(seg, nums[nc + len(seg):]))
        from pipelines.ingest.batches import SkipReport

        mine = SkipReport()
        for p in seg:
            mine = mine.merge(counters[p].skipped)
        reports = [None] * self.world
        dist.all_gather_object(reports, mine)
        for pid in seg:
            expected = job.rows.get(pid)
            if expected is not None and rows[pid] != expected:
                raise RuntimeError(f"pass {k.pass_no} ({k.name}) partition {pid}: workers read {rows[pid]} rows, "
                                   f"expected {expected}")
        t = self.totals
        t.done.extend(seg)
        for name, v in zip(k.count_names, nums[:nc]):
            t.counts[name] = t.counts.get(name, 0) + v
        t.rows.update(rows)
        t.invalid.update(invalid)
        for r in reports:
            t.skipped = t.skipped.merge(r)
        self.progress.partition_done(sum(rows.values()))
        self.rec["images"] += sum(rows.values())
        self.rec["invalid"] += sum(invalid.values())
        self.rec["computed"].extend(seg)
        rec["reduce_s"] += time.perf_counter() - t0
        flat = k.flatten(state) if self.rank == 0 else None
        if self.rank != 0 and not keep:
            k.clear(state)
        return flat

    def _checkpoint(self, flat, final: bool) -> None:
        k, job = self.kind, self.job
        t0 = time.perf_counter()
        tensors = {n: v.detach().cpu().contiguous() for n, v in k.to_tensors(flat).items()}
        meta = {"format": k.fmt, "fingerprint": job.fingerprint, "pass": k.name, "final": final,
                "run_id": job.run_id, "world_size": self.world, "written_at": time.time(), **self.totals.to_meta()}
        uri, nbytes = save_checkpoint(self.base_uri, tensors, meta, job.store)
        dt = time.perf_counter() - t0
        self.rec["write_s"] += dt
        self.rec["bytes_written"] += nbytes
        self.rec["checkpoints"] += 1
        say(f"[{k.tag}] {self.progress.label}: checkpoint of {len(self.totals.done)} of {len(self.ids)} "
            f"partition{'s' if len(self.ids) != 1 else ''} in {uri} ({nbytes / 2**20:.1f} MiB, {dt:.1f} s)")
