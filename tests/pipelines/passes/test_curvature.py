"""pipelines.passes.curvature on a real local Ray: 2 Train workers over 4 partitions.

Four ``TorchTrainer.fit`` calls in all (each costs ~11-16 s of Ray Train overhead here):

* ``local_run`` (module scope): images with bad files in them, float64, MC
  Fisher (labels drawn from (seed, image key), so sharding does not matter), every method,
  the default checkpoint interval (one all-reduce per pass, of exactly the packed payload).
  Checked against one process running
  ``collect_statistics`` / ``collect_efb`` over the valid images (A, G, diag, efb at
  1e-10 of each tensor's scale), the skip counts, and posteriors built by the posterior
  stage from the stored statistics vs from the single-process sums (dense precision of every layer).
* S3: images read from and artifacts written to moto's server, with a worker killed
  mid-partition of the EFB pass (``checkpoint_every_s=0``, ``FailureConfig(max_failures=1)``
  restarts the group, which resumes from the pass checkpoints and the eigenbasis): same
  statistics as one process.
* resume: a job killed in partition 2 with ``max_failures=0`` (fit raises) after the
  checkpoint of partitions 0 and 1, then re-submitted at the default interval: only
  partitions 2 and 3 are computed, same statistics as one process.

The MC Fisher draws each label from ``(seed, key of the image's path, draw)``
(:class:`laplace_core.curvature.keyed_rng.KeyedSampler`), so 2 workers, a restarted worker and
one process all draw the same labels and the sums agree to round-off.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import imagegen
from laplace_core.curvature.collect import collect_efb, collect_statistics
from laplace_core.posteriors.structures.base import load_posterior
from laplace_core.curvature.keyed_rng import KeyedSampler
from laplace_core.posteriors.build import build_posterior
from pipelines.storage.store import RunStore
from pipelines.config.schema import ModelSpec
from pipelines.storage import uris as storage
from pipelines.passes.curvature import (
    CurvatureConfig,
    buckets,
    efb_partition_ids,
    pass_uri,
    path_keys,
    run_curvature,
)
from pipelines.distributed import unpack_symmetric
from pipelines.distributed.kinds import efb_payload_numbers, pass1_payload_numbers
from pipelines.passes.eigen import load_eigenbasis
from pipelines.passes.posterior import build_posteriors
from pipelines.ingest.batches import iter_local_batches
from pipelines.ingest.index import DataConfig, partition
from pipelines.ingest.scan import scan
from pipelines.ingest.models import load_model, tiny_cnn

METHODS = ("diag", "kfac", "kfac_exact", "efb", "inf")
NUM_PARTS = 4
TOL = 1e-10  # of each tensor's max magnitude (float64 sums of ~24 examples)


def _cfg(**kw) -> CurvatureConfig:
    base = dict(num_workers=2, cpus_per_worker=0.5, use_gpu=False, fisher="mc", model_dtype="float64",
                batch_size=3, methods=METHODS, efb_fraction=0.5, max_failures=0, torch_threads=1,
                log_every_s=2.0)
    base.update(kw)
    return CurvatureConfig(**base)


def _data_cfg(root: str, endpoint=None) -> DataConfig:
    # explicit class list: S3 has no empty "folders", so the empty class would vanish there
    return DataConfig(root=root, split="train", image_size=12, resize_size=12, decode_batch_size=2,
                      decode_num_cpus=0.25, storage_options=None if endpoint is None else storage.StorageOptions(endpoint),
                      classes=imagegen.ALL_CLASSES)


def _close(a: torch.Tensor, b: torch.Tensor, tol: float = TOL) -> bool:
    scale = max(float(b.abs().max()), 1e-300)
    return float((a - b).abs().max()) <= tol * scale


def _assert_stats_equal(got, ref, what: str, efb: bool = True):
    assert got.count == ref.count, what
    assert list(got.layers) == list(ref.layers), what
    for k in ref.layers:
        for f in ("A", "G", "diag"):
            assert _close(getattr(got.layers[k], f), getattr(ref.layers[k], f)), f"{what}: {k}.{f}"
    if efb:
        assert got.has_efb and ref.has_efb, what
        assert got.efb_count == ref.efb_count, what
        for k in ref.layers:
            assert _close(got.layers[k].efb, ref.layers[k].efb), f"{what}: {k}.efb"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """Image tree (with bad files), partitions, model weights and the single-process reference."""
    tmp = tmp_path_factory.mktemp("curv")
    tree = imagegen.make_imagenet_tree(tmp / "images", per_class=5, bad=True, size=(16, 14))
    dcfg = _data_cfg(str(tmp / "images"))
    parts = partition(scan(dcfg), num_partitions=NUM_PARTS)
    weights = tmp / "tiny.pt"
    torch.save(tiny_cnn(num_classes=len(tree.classes)).state_dict(), weights)
    spec = ModelSpec(name="tiny_cnn", weights=str(weights), num_classes=len(tree.classes))
    model = load_model(spec.name, spec.weights, spec.num_classes).to(torch.float64)

    def valid_batches(ps):
        for p in ps:
            for b in iter_local_batches(p, dcfg, batch_size=4):
                v = torch.from_numpy(b["valid"])
                if v.any():
                    keys = path_keys([str(q) for q in b["path"][b["valid"]]])
                    yield torch.from_numpy(b["image"])[v].to(torch.float64), torch.from_numpy(b["label"])[v], keys

    ref = collect_statistics(model, valid_batches(parts), fisher="mc", generator=KeyedSampler(0))
    return dict(tmp=tmp, tree=tree, dcfg=dcfg, parts=parts, spec=spec, model=model, ref=ref,
                valid_batches=valid_batches)


@pytest.fixture(scope="module")
def local_run(setup, ray_session):
    out = str(setup["tmp"] / "out_local")
    res = run_curvature(setup["spec"], setup["parts"], _cfg(), RunStore.open(out), data_config=setup["dcfg"])
    assert res.stats.count > 0 and _cfg().checkpoint_every_s == 600.0  # the default interval
    posteriors = build_posteriors(RunStore.open(out), METHODS, 6)  # the posterior stage
    return res, out, posteriors


def _reference_with_efb(setup, basis):
    """Single-process EFB sums over the EFB partitions, in the run's basis."""
    parts = setup["parts"]
    efb_ids = efb_partition_ids([p.id for p in parts], {}, 0.5)
    efb, n = collect_efb(setup["model"], setup["valid_batches"]([parts[i] for i in efb_ids]), basis,
                         fisher="mc", generator=KeyedSampler(0))
    return setup["ref"].with_efb(efb, n), efb_ids


# ---------------------------------------------------------------------------- local run
def test_two_workers_equal_single_process(setup, local_run):
    res, out, _ = local_run
    ref, efb_ids = _reference_with_efb(setup, res.basis)
    assert res.efb_partitions == tuple(efb_ids) == (0, 2)
    assert res.computed_partitions == {"pass1": (0, 1, 2, 3), "pass2": (0, 2)}
    _assert_stats_equal(res.stats, ref, "2 workers vs 1 process")
    # the eigenbasis the workers computed (spread over ranks) diagonalises the reference factors
    for k, ls in ref.layers.items():
        b = res.basis[k]
        assert _close(b.U_A @ torch.diag(b.S_A) @ b.U_A.T, ls.A / ref.count, 1e-9), k
        assert _close(b.U_G @ torch.diag(b.S_G) @ b.U_G.T, ls.G / ref.count, 1e-9), k
    assert _close(load_eigenbasis(os.path.join(out, "stats", "eigenbasis"))[k].U_A, res.basis[k].U_A, 0.0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_one_gpu_worker_with_nccl_equals_single_process(setup, ray_session):
    """``use_gpu=True``: Ray Train gives the worker the GPU and an NCCL process group; the
    float64 sums computed there (both passes, eigenbasis on the GPU) equal one CPU process's."""
    from pipelines.storage import uris as storage

    out = str(setup["tmp"] / "out_gpu")
    res = run_curvature(setup["spec"], setup["parts"], _cfg(num_workers=1, use_gpu=True), RunStore.open(out),
                        data_config=setup["dcfg"])
    assert res.use_gpu
    rep = storage.read_json(os.path.join(out, "stats", "worker_report.json"))
    assert rep["device"].startswith("cuda") and rep["backend"] == "nccl", rep
    ref, _ = _reference_with_efb(setup, res.basis)
    _assert_stats_equal(res.stats, ref, "1 GPU worker vs 1 CPU process")
    for k, ls in ref.layers.items():
        b = res.basis[k]
        assert _close(b.U_A @ torch.diag(b.S_A) @ b.U_A.T, ls.A / ref.count, 1e-9), k


def test_skip_counts(setup, local_run):
    res, _, _ = local_run
    tree = setup["tree"]
    n_files = len(tree.train_good) + len(tree.train_bad)
    sk = res.skipped["pass1"]
    assert sk["rows"] == n_files
    assert sk["skipped"]["count"] == len(tree.train_invalid) == 4
    assert sorted(e["path"] for e in sk["skipped"]["examples"]) == sorted(tree.train_invalid)
    assert res.stats.count == n_files - 4 == setup["ref"].count


def test_posteriors_equal_single_process(setup, local_run):
    res, out, posteriors = local_run
    ref, _ = _reference_with_efb(setup, res.basis)
    assert set(posteriors) == set(METHODS)
    g = torch.Generator().manual_seed(0)
    for method in METHODS:
        saved = load_posterior(os.path.join(out, "posterior", method))
        built = build_posterior(ref, method, rank=6 if method == "inf" else None, basis=res.basis)
        assert saved.num_stored() == built.num_stored() == posteriors[method]["num_stored"]
        for k in built.layers:
            d_saved, d_built = saved.to_dense(k), built.to_dense(k)
            assert _close(d_saved, d_built, 1e-8), f"{method}/{k}"
        z = {k: torch.randn(lp.shape, generator=g, dtype=torch.float64) for k, lp in built.layers.items()}
        sm, bm = saved.scale_matvec(z), built.scale_matvec(z)
        for k in z:
            assert _close(sm[k], bm[k], 1e-7), f"{method}/{k} scale_matvec"


def test_summary_json(local_run):
    """Default interval: exactly one all-reduce per pass, of exactly the payload (upper
    triangles of A and G + the diagonal; the EFB sums), on every rank; rank 0 writes one
    pass-1 checkpoint of that payload (the finished pass) and none for the EFB pass."""
    import json

    res, out, _ = local_run
    summary = json.loads(Path(out, "stats", "curvature.json").read_text())
    assert summary["count"] == res.stats.count and summary["efb_partitions"] == [0, 2]
    shapes = [tuple(i.shape) for i in res.stats.infos.values()]
    p1, p2 = 8 * pass1_payload_numbers(shapes), 8 * efb_payload_numbers(shapes)
    full = 8 * sum(n * n + m * m + m * n for m, n in shapes)
    assert p1 < full
    w = summary["timings"]["worker"]
    assert w["pass1"]["allreduce_bytes"] == p1 and w["pass1"]["reduces"] == 1 == w["pass1"]["allreduce_calls"]
    assert w["pass2"]["allreduce_bytes"] == p2 and w["pass2"]["reduces"] == 1 == w["pass2"]["allreduce_calls"]
    assert res.allreduce_bytes == p1 + p2
    assert summary["timings"]["fit_s"] > 0
    ranks = w["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1] and all(r["pass1"]["computed"] == list(range(NUM_PARTS)) for r in ranks)
    passes = summary["passes"]
    for name, payload in (("pass1", p1), ("pass2", p2)):
        recs = passes[name]["ranks"]
        assert len(recs) == 2 and all(r["reduces"] == 1 and r["allreduce_bytes"] == payload for r in recs), name
        assert all(r[k] >= 0 for r in recs for k in ("compute_s", "data_wait_s", "reduce_s", "write_s")), name
    assert [r["bytes_written"] for r in passes["pass1"]["ranks"]] == [p1, 0]
    # each partition's Ray Data executor (reference cycles) is collected when it ends, not left to pile up
    assert all(r["gc_freed"] > 0 for r in passes["pass1"]["ranks"]), passes["pass1"]["ranks"]
    assert [r["bytes_written"] for r in passes["pass2"]["ranks"]] == [0, 0]


def test_final_checkpoint_holds_the_reduced_sums(setup, local_run):
    """The finished pass 1's checkpoint stores the upper triangles of A and G and the diagonal:
    unpacked, they are the reduced statistics bit for bit."""
    from laplace_core.io import load_tensors

    res, out, _ = local_run
    base = pass_uri(out, "pass1")
    assert storage.listdir(base) == [f"ckpt-{NUM_PARTS:06d}"]
    tensors, meta = load_tensors(storage.join(base, f"ckpt-{NUM_PARTS:06d}"))
    assert meta["final"] and meta["done"] == list(range(NUM_PARTS)) and meta["counts"]["count"] == res.stats.count
    for k, info in res.stats.infos.items():
        m, n = info.shape
        ls = res.stats.layers[k]
        assert tensors[f"{k}/A_triu"].numel() == n * (n + 1) // 2
        assert torch.equal(unpack_symmetric(tensors[f"{k}/A_triu"], n), ls.A), k
        assert torch.equal(unpack_symmetric(tensors[f"{k}/G_triu"], m), ls.G), k
        assert torch.equal(tensors[f"{k}/diag"], ls.diag), k
        assert torch.equal(ls.A, ls.A.T) and torch.equal(ls.G, ls.G.T)
    assert storage.listdir(pass_uri(out, "pass2")) == []  # the finished EFB pass went to stats/reduced


# ---------------------------------------------------------------------------- S3 + worker killed
def test_s3_with_worker_killed_mid_pass(setup, ray_session, s3_bucket):
    import s3fs

    bucket, endpoint = s3_bucket
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint})
    fs.put(str(setup["tmp"] / "images") + "/", bucket[len("s3://"):] + "/images/", recursive=True)
    dcfg = _data_cfg(f"{bucket}/images", endpoint)
    parts = partition(scan(dcfg), num_partitions=NUM_PARTS)
    assert [(p.paths, p.labels) for p in parts] == [(p.paths, p.labels) for p in setup["parts"]]
    marker = f"{bucket}/fault-marker.json"
    # killed in the EFB pass: the restarted group skips every pass-1 partition and EFB
    # partition 0, reloads the saved eigenbasis and recomputes EFB partition 2 only
    cfg = _cfg(max_failures=1, checkpoint_every_s=0.0,
               fault_injection={"pass": 2, "partition": 2, "rank": 0, "once_marker": marker})  # rank 0: see below
    store = RunStore.open(f"{bucket}/out", storage.StorageOptions(endpoint))
    res = run_curvature(setup["spec"], parts, cfg, store, data_config=dcfg)
    assert fs.exists(marker[len("s3://"):]), "the fault was not injected"
    worker = res.timings["worker"]  # rank 0 of the last (restarted) attempt
    assert worker["eigenbasis"] == "loaded" and worker["pass1"]["computed"] == []
    assert worker["pass2"]["computed"] == [2] and worker["pass2"]["reused"] == [0]
    ref, _ = _reference_with_efb(setup, res.basis)
    _assert_stats_equal(res.stats, ref, "S3 with a killed worker vs 1 process")
    build_posteriors(store, ("inf",), 6)  # the posterior stage, from S3
    assert fs.exists(f"{bucket[5:]}/out/posterior/inf/manifest.json")
    assert res.skipped["pass1"]["skipped"]["count"] == 4


# ---------------------------------------------------------------------------- resume after a failed job
def test_resume_computes_only_missing_partitions(setup, ray_session):
    out = str(setup["tmp"] / "out_resume")
    marker = str(setup["tmp"] / "resume-marker.json")
    # rank 0 is killed: it commits each checkpoint before it reads on; a fault on another rank could
    # fire while rank 0 still writes the checkpoint of partitions 0 and 1, and the kill would lose it
    cfg = _cfg(max_failures=0, methods=("diag",), checkpoint_every_s=0.0,
               fault_injection={"pass": 1, "partition": 2, "rank": 0, "once_marker": marker})
    with pytest.raises(Exception):
        run_curvature(setup["spec"], setup["parts"], cfg, RunStore.open(out), data_config=setup["dcfg"])
    assert os.path.exists(marker)
    base = pass_uri(out, "pass1")
    assert storage.listdir(base) == ["ckpt-000002"]  # the checkpoint of partitions 0 and 1 (ckpt-000001 removed)
    assert storage.read_json(os.path.join(base, "ckpt-000002", "manifest.json"))["meta"]["done"] == [0, 1]

    # re-submitted at the default interval, tiny all-reduce buckets (2 KiB): the statistics
    # travel in many flat buffers
    res = run_curvature(setup["spec"], setup["parts"], _cfg(methods=("diag",), bucket_mb=2 / 1024), RunStore.open(out),
                        data_config=setup["dcfg"])
    assert res.computed_partitions["pass1"] == (2, 3) and res.reused_partitions["pass1"] == (0, 1)
    w = res.timings["worker"]["pass1"]
    assert w["computed"] == [2, 3] and w["reused"] == [0, 1] and w["reduces"] == 1
    assert w["resumed_from"].endswith("ckpt-000002")
    assert w["allreduce_calls"] > 2  # > 1 bucket per reduce
    assert storage.listdir(base) == [f"ckpt-{NUM_PARTS:06d}"]
    _assert_stats_equal(res.stats, setup["ref"], "resumed vs 1 process", efb=False)  # A, G, diag (no EFB here)
    assert not res.stats.has_efb


def test_corrupt_newest_checkpoint_falls_back(tmp_path, capsys):
    """Pure helper (no Ray): the newest checkpoint truncated -> one line, the one before it is
    used; none left -> a fresh start (None)."""
    from laplace_core.io import save_tensors
    from pipelines.distributed import load_checkpoint

    base = str(tmp_path / "pass1")
    for k in (1, 2):
        save_tensors(f"{base}/ckpt-{k:06d}", {"t0000": torch.full((3,), float(k), dtype=torch.float64)},
                     {"format": "f", "fingerprint": "fp", "done": list(range(k))})
    data = next(p for p in os.listdir(f"{base}/ckpt-000002") if p != "manifest.json")
    with open(f"{base}/ckpt-000002/{data}", "r+b") as f:
        f.truncate(10)
    uri, meta, tensors = load_checkpoint(base, "fp", RunStore(), "f")
    assert uri.endswith("ckpt-000001") and meta["done"] == [0] and float(tensors["t0000"][0]) == 1.0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "ckpt-000002" in ln]
    assert len(lines) == 1 and "is unusable" in lines[0] and "computed again" in lines[0]
    assert load_checkpoint(base, "other-fingerprint", RunStore(), "f") is None


# ---------------------------------------------------------------------------- pure helpers (no Ray)
def test_efb_partition_ids():
    assert efb_partition_ids([0, 1, 2, 3], {}, 1.0) == (0, 1, 2, 3)
    assert efb_partition_ids([0, 1, 2, 3], {}, 0.5) == (0, 2)
    assert efb_partition_ids([0, 1, 2, 3, 4], {}, 0.2) == (0,)
    rows = {0: 10, 1: 10, 2: 10, 3: 10}
    assert efb_partition_ids([0, 1, 2, 3], rows, 1.0, max_examples=15) == (0, 2)
    with pytest.raises(ValueError, match="known sizes"):
        efb_partition_ids([0, 1], {0: None, 1: 3}, 1.0, max_examples=2)


def test_buckets():
    ts = [torch.zeros(n, dtype=torch.float64) for n in (10, 300, 5, 5, 1000, 1)]  # 8 bytes each
    groups = buckets(ts, 800)
    assert groups == [[0], [1], [2, 3], [4], [5]]
    assert sum(groups, []) == list(range(len(ts)))
    assert buckets(ts, 10**9) == [list(range(len(ts)))]


def test_gpu_shortfall_line():
    from pipelines.passes.curvature import gpu_shortfall

    assert gpu_shortfall(16, 16.0) is None and gpu_shortfall(1, 8.0) is None
    line = gpu_shortfall(16, 0.0)
    assert "ask for 16 GPU(s), the cluster has 0 now" in line and "curvature.use_gpu=false" in line
    assert "\n" not in line


def test_config_errors():
    with pytest.raises(ValueError, match="unknown fisher"):
        CurvatureConfig(fisher="exact")
    with pytest.raises(ValueError, match="unknown posterior method"):
        CurvatureConfig(methods=("diag", "laplace"))
    with pytest.raises(ValueError, match="efb_fraction"):
        CurvatureConfig(efb_fraction=0.0)
    with pytest.raises(ValueError, match="checkpoint_every_s must be >= 0"):
        CurvatureConfig(checkpoint_every_s=-1)
    from pipelines.config.schema import ConfigError
    from pipelines.config.load import load_config

    assert load_config("smoke", []).curvature.checkpoint_every_s == 600.0
    assert load_config("smoke", ["curvature.checkpoint_every_s=0"]).curvature.checkpoint_every_s == 0.0
    with pytest.raises(ConfigError, match="curvature.checkpoint_every_s must be >= 0"):
        load_config("smoke", ["curvature.checkpoint_every_s=-1"])
    with pytest.raises(ValueError, match="unknown fault_injection keys"):
        CurvatureConfig(fault_injection={"partition": 1, "once_marker": "x", "when": 3})


@pytest.mark.parametrize("n", [1, 3, 9])
def test_symmetric_packing_round_trip(n, monkeypatch):
    """Upper triangle row by row (``torch.triu_indices`` order), both paths (cached index; row by
    row above ``INDEX_MAX_N``, here lowered to 4); unpacking rebuilds the matrix exactly."""
    from pipelines.distributed import comm

    monkeypatch.setattr(comm, "INDEX_MAX_N", 4)
    g = torch.Generator().manual_seed(n)
    a = torch.randn(n, n, generator=g, dtype=torch.float64)
    a = a + a.T
    p = comm.pack_symmetric(a)
    r, c = torch.triu_indices(n, n)
    assert p.numel() == comm.packed_size(n) == n * (n + 1) // 2 and torch.equal(p, a[r, c])
    assert torch.equal(comm.unpack_symmetric(p, n), a)
    out = torch.full((n, n), float("nan"), dtype=torch.float64)
    assert comm.unpack_symmetric(p, n, out=out) is out and torch.equal(out, a)
    with pytest.raises(ValueError, match="upper triangle"):
        comm.unpack_symmetric(p[:-1] if n > 1 else torch.zeros(2), n)
