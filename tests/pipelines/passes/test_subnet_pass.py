"""pipelines.passes.subnet on a real local Ray: 2 Train workers over 2 partitions, one fit.

The single-process reference is :func:`laplace_core.curvature.subnet_fisher.collect_subnet_fisher` over the
valid images with the MC labels drawn independently here (``keyed_categorical`` on the
model's softmax, ``(seed, key of the image path, draw)``, 2 draws). Checks, float64:

* the all-reduced ``S x S`` Fisher sum and count equal the reference (1e-10 of its scale);
* its diagonal equals the Fisher diagonal that ``collect_statistics`` (another code path,
  ``KeyedSampler``) collects at the selected entries: the labels are the pass-1 labels;
* the selection is the Wasserstein rule on the reduced statistics written under
  ``<output>/stats/reduced`` (largest ``1 / (N diag/M + τ)``);
* the posterior built from the artifact has the dense precision ``N F/M + τ (S/D) I``;
* a worker killed mid-pass: the restarted group resumes from the checkpoint of the running
  sum and computes only the other partition, same result;
* a second call reuses the artifact (no fit); too large an ``S`` fails up front in one
  line naming the largest ``S`` that fits (pipeline and job config).
"""
from __future__ import annotations

import os

import pytest
import torch

import imagegen
from laplace_core.curvature.collect import collect_statistics
from laplace_core.curvature.keyed_rng import KeyedSampler, keyed_categorical
from laplace_core.posteriors.structures.base import vec
from laplace_core.curvature.subnet_fisher import collect_subnet_fisher
from laplace_core.posteriors.subnet import marginal_variances
from pipelines.storage.store import RunStore
from pipelines.config.schema import ConfigError, ModelSpec
from pipelines.config.load import load_config
from pipelines.passes.curvature import CurvatureConfig, path_keys, reduced_uri
from pipelines.ingest.batches import iter_local_batches
from pipelines.ingest.index import DataConfig, partition
from pipelines.ingest.scan import scan
from pipelines.distributed import pack_symmetric
from pipelines.ingest.models import load_model, tiny_cnn
from pipelines.passes.posterior import build_and_save
from pipelines.passes.subnet import (
    GGN_MAX_CLASSES,
    SubnetConfig,
    latest_checkpoint,
    load_checkpoint,
    load_subnet_fisher,
    resolve_subnet_fisher,
    run_subnet_pass,
    subnet_partial_uri,
    subnet_uri,
)

S = 60
MC = 2
SEED = 3
TOL = 1e-10  # of the reference's max magnitude (float64 sums of ~20 examples)

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def _close(a: torch.Tensor, b: torch.Tensor, tol: float = TOL) -> bool:
    scale = max(float(b.abs().max()), 1e-300)
    return float((a - b).abs().max()) <= tol * scale


def _cfg(**kw) -> CurvatureConfig:
    base = dict(num_workers=2, cpus_per_worker=0.5, use_gpu=False, fisher="mc", mc_samples=MC, seed=SEED,
                model_dtype="float64", batch_size=3, methods=("diag",), max_failures=0, torch_threads=1,
                log_every_s=2.0)
    base.update(kw)
    return CurvatureConfig(**base)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("subnet")
    tree = imagegen.make_imagenet_tree(tmp / "images", per_class=5, bad=True, size=(16, 14))
    dcfg = DataConfig(root=str(tmp / "images"), split="train", image_size=12, resize_size=12, decode_batch_size=2,
                      decode_num_cpus=0.25, classes=imagegen.ALL_CLASSES)
    parts = partition(scan(dcfg), num_partitions=2)
    weights = tmp / "tiny.pt"
    torch.manual_seed(0)
    torch.save(tiny_cnn(num_classes=len(tree.classes)).state_dict(), weights)
    spec = ModelSpec(name="tiny_cnn", weights=str(weights), num_classes=len(tree.classes))
    model = load_model(spec.name, spec.weights, spec.num_classes).to(torch.float64).eval()

    def valid_batches():
        for p in parts:
            for b in iter_local_batches(p, dcfg, batch_size=4):
                v = torch.from_numpy(b["valid"])
                if v.any():
                    keys = path_keys([str(q) for q in b["path"][b["valid"]]])
                    yield torch.from_numpy(b["image"])[v].to(torch.float64), torch.from_numpy(b["label"])[v], keys

    # pass-1 statistics as the curvature stage leaves them (same keyed labels, same data)
    stats = collect_statistics(model, valid_batches(), fisher="mc", mc_samples=MC, generator=KeyedSampler(SEED))
    out = tmp / "out"
    stats.save(reduced_uri(str(out)))
    return dict(tmp=tmp, dcfg=dcfg, parts=parts, spec=spec, model=model, stats=stats, out=str(out),
                valid_batches=valid_batches)


@pytest.fixture(scope="module")
def ray_run(setup, ray_session):
    scfg = SubnetConfig(subnet_size=S, fisher="mc", prior_precision=2.0)
    res = run_subnet_pass(setup["spec"], setup["parts"], _cfg(), scfg, RunStore.open(setup["out"]),
                          data_config=setup["dcfg"])
    return res, scfg


def _reference(setup, masks):
    """One process: the keyed MC labels drawn here, then collect_subnet_fisher with them."""
    model = setup["model"]

    def labelled():
        for x, _, keys in setup["valid_batches"]():
            with torch.no_grad():
                probs = torch.softmax(model(x), dim=1)
            for s in range(MC):
                yield x, keyed_categorical(probs, SEED, keys, s)

    F, n = collect_subnet_fisher(model, labelled(), masks, fisher="empirical")
    return F / MC, n // MC


def test_two_workers_equal_single_process(setup, ray_run):
    res, _ = ray_run
    F, count, masks, meta = load_subnet_fisher(subnet_uri(setup["out"]))
    F_ref, n_ref = _reference(setup, masks)
    assert res.computed and res.subnet_size == S == F.shape[0] == meta["subnet_size"]
    assert count == n_ref == setup["stats"].count == res.count
    assert F.dtype == torch.float64 and _close(F, F_ref)
    assert _close(F, F.T, 0.0)
    assert res.rows == sum(len(p) for p in setup["parts"]) and res.skipped["count"] > 0  # bad files counted
    assert res.computed_partitions == tuple(p.id for p in setup["parts"]) and res.reused_partitions == ()
    # the diagonal is pass 1's exact Fisher diagonal at the selected entries (same labels)
    diag_sel = torch.cat([vec(setup["stats"].layers[k].diag)[vec(mk)] for k, mk in masks.items()])
    assert _close(torch.diagonal(F), diag_sel)


def test_selection_is_wasserstein_on_reduced_stats(setup, ray_run):
    _, scfg = ray_run
    _, _, masks, meta = load_subnet_fisher(subnet_uri(setup["out"]))
    var = marginal_variances(setup["stats"], prior_precision=2.0)
    flat_var = torch.cat([vec(v) for v in var.values()])
    flat_sel = torch.cat([vec(masks[k]) for k in var])
    assert int(flat_sel.sum()) == S and meta["d_total"] == flat_var.numel()
    assert float(flat_var[flat_sel].min()) >= float(flat_var[~flat_sel].max())


def test_posterior_from_artifact(setup, ray_run):
    out = build_and_save(setup["stats"], None, ["subnet"], None, RunStore.open(setup["out"]), n_data=50.0,
                         prior_precision=2.0)
    F, count, _, meta = load_subnet_fisher(subnet_uri(setup["out"]))
    from laplace_core.posteriors.structures.base import load_posterior

    post = load_posterior(out["subnet"]["uri"])
    D = meta["d_total"]
    dense = 50.0 * F / count + 2.0 * (S / D) * torch.eye(S, dtype=torch.float64)
    assert post.method == "subnet" and out["subnet"]["subnet_size"] == S and out["subnet"]["d_total"] == D
    assert _close(post.to_dense().to(torch.float64), dense, 1e-12)


def test_second_call_reuses_the_artifact(setup, ray_run):
    _, scfg = ray_run
    res = run_subnet_pass(setup["spec"], setup["parts"], _cfg(), scfg, RunStore.open(setup["out"]), data_config=setup["dcfg"])
    assert not res.computed and res.fit_s == 0.0 and res.subnet_size == S


def test_memory_check_names_the_largest_S(setup):
    scfg = SubnetConfig(subnet_size=300, fisher="mc", memory_budget_bytes=8 * 100 * 100)
    with pytest.raises(ValueError) as e:  # before any Ray work: the fixture's Ray is not needed
        run_subnet_pass(setup["spec"], setup["parts"], _cfg(), scfg, RunStore.open(setup["out"]), data_config=setup["dcfg"])
    msg = str(e.value)
    assert "\n" not in msg and "S = 300" in msg and "largest S that fits is 100" in msg


def test_job_config_memory_check_and_fisher_choice():
    with pytest.raises(ConfigError) as e:
        load_config("smoke", ["posterior.methods=[subnet]", "posterior.subnet_size=30000"])
    assert "largest S that fits is 23170" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="subnet_fisher"):
        load_config("smoke", ["posterior.methods=[subnet]", "posterior.subnet_fisher=kfac"])
    assert load_config("smoke", ["posterior.methods=[subnet]"]).posterior.subnet_size <= 1000
    assert resolve_subnet_fisher("auto", GGN_MAX_CLASSES, "mc") == "ggn"
    assert resolve_subnet_fisher("auto", 1000, "empirical") == "empirical"
    assert resolve_subnet_fisher("mc", 3) == "mc"
    with pytest.raises(ValueError, match="valid: auto, mc, empirical, ggn"):
        resolve_subnet_fisher("exact", 3)


def test_job_config_subnet_rule():
    """``posterior.subnet_rule`` reaches the pass's SubnetConfig; unknown rules fail in one line."""
    from pipelines.passes.subnet import subnet_config

    cfg = load_config("smoke", ["posterior.methods=[subnet]"])
    assert cfg.posterior.subnet_rule == "wasserstein"  # the paper's rule stays the default
    assert subnet_config(cfg.posterior, "mc", 3).rule == "wasserstein"
    cfg = load_config("smoke", ["posterior.methods=[subnet]", "posterior.subnet_rule=wasserstein_live"])
    assert subnet_config(cfg.posterior, "mc", 3).rule == "wasserstein_live"
    with pytest.raises(ConfigError) as e:
        load_config("smoke", ["posterior.methods=[subnet]", "posterior.subnet_rule=live"])
    msg = str(e.value)
    assert "\n" not in msg and "posterior.subnet_rule" in msg and "valid: wasserstein, wasserstein_live, random" in msg


def test_zero_fisher_note_comes_with_the_live_rule_hint(setup, ray_run, capsys):
    """Reuses the artifact (no fit): the log notes zero-Fisher selected weights and, with the
    default rule, hints at ``posterior.subnet_rule=wasserstein_live`` exactly when there are any."""
    _, scfg = ray_run
    capsys.readouterr()
    res = run_subnet_pass(setup["spec"], setup["parts"], _cfg(), scfg, RunStore.open(setup["out"]), data_config=setup["dcfg"])
    log = capsys.readouterr().out
    assert not res.computed and scfg.rule == "wasserstein"
    assert ("subnet_rule=wasserstein_live" in log) == (res.zero_fisher > 0), (res.zero_fisher, log)
    assert ("zero Fisher diagonal" in log) == (res.zero_fisher > 0)


def test_killed_worker_resumes_from_the_checkpoint(setup, ray_session, s3_bucket):
    """Output on S3 (moto on 127.0.0.1), a worker killed in the second partition
    (``max_failures=1``): the restarted group loads the checkpoint written after the first
    partition (``checkpoint_every_s=0``), computes only the second and gives the
    single-process result; the checkpoints are removed at the end."""
    from pipelines.storage import uris as storage

    bucket, endpoint = s3_bucket
    out = f"{bucket}/out_resume"
    store = RunStore.open(out, storage.StorageOptions(endpoint))
    setup["stats"].save(reduced_uri(out), store.fsspec_options(out))
    marker = str(setup["tmp"] / "subnet-fault.json")
    ids = [p.id for p in setup["parts"]]
    # rank 0: it commits the checkpoint before it reads the next partition; another rank can reach
    # its fault while rank 0 still writes, and the killed group then leaves no checkpoint to resume
    cfg = _cfg(max_failures=1, fault_injection={"pass": 3, "partition": ids[1], "rank": 0, "once_marker": marker})
    scfg = SubnetConfig(subnet_size=S, fisher="mc", prior_precision=2.0, checkpoint_every_s=0.0)
    res = run_subnet_pass(setup["spec"], setup["parts"], cfg, scfg, store, data_config=setup["dcfg"])
    assert os.path.exists(marker), "the fault was not injected"
    assert res.computed and res.reused_partitions == (ids[0],) and res.computed_partitions == (ids[1],)
    F, count, masks, meta = load_subnet_fisher(subnet_uri(out), store)
    F_ref, n_ref = _reference(setup, masks)
    assert count == n_ref == res.count and _close(F, F_ref)
    assert res.rows == sum(len(p) for p in setup["parts"]) and res.skipped["count"] > 0
    assert store.listdir(subnet_partial_uri(out)) == []


def test_a_corrupt_checkpoint_is_passed_over_not_fatal(tmp_path, capsys):
    """Pure helper (no Ray): ``load_checkpoint`` returns the most advanced checkpoint that loads
    and passes its SHA-256 check; a truncated tensors file or a garbled manifest is reported
    in one line and skipped (its partitions are computed again), none usable -> None."""
    from laplace_core.io import save_tensors

    base = str(tmp_path / "partial")

    def write(k):
        save_tensors(f"{base}/ckpt-{k:06d}", {"fisher_triu": pack_symmetric(torch.eye(2, dtype=torch.float64) * k)},
                     {"format": "infoform.subnet_fisher_partial", "fingerprint": "fp", "done": list(range(k)),
                      "count": k, "rows": {}, "invalid": {}, "skipped": {"count": 0, "examples": []}})

    for k in (1, 2, 3):
        write(k)
    with open(f"{base}/ckpt-000003/manifest.json", "w") as f:
        f.write('{"format": "infoform.artifact", "meta": {"done": [0, 1')  # cut mid-write
    tensors_file = next(p for p in os.listdir(f"{base}/ckpt-000002") if p != "manifest.json")
    with open(f"{base}/ckpt-000002/{tensors_file}", "r+b") as f:
        f.truncate(20)
    uri, meta, F = load_checkpoint(base, "fp")
    assert uri.endswith("ckpt-000001") and meta["done"] == [0] and torch.equal(F, torch.eye(2, dtype=torch.float64))
    out = capsys.readouterr().out
    assert "ckpt-000003 has an unreadable manifest" in out
    assert "ckpt-000002 is unusable" in out and "computed again" in out and "Traceback" not in out
    os.remove(f"{base}/ckpt-000001/{tensors_file}")
    assert load_checkpoint(base, "fp") is None
    assert load_checkpoint(str(tmp_path / "none"), "fp") is None


def test_latest_checkpoint_takes_the_most_advanced_committed_one(tmp_path):
    """Pure helper (no Ray): the checkpoint with most finished partitions among those with a
    committed manifest and the same fingerprint; none -> None."""
    from laplace_core.io import save_tensors

    base = str(tmp_path / "partial")
    assert latest_checkpoint(base, "fp") is None

    def write(k, fp):
        save_tensors(f"{base}/ckpt-{k:06d}", {"fisher_triu": pack_symmetric(torch.eye(2, dtype=torch.float64) * k)},
                     {"format": "infoform.subnet_fisher_partial", "fingerprint": fp, "done": list(range(k)),
                      "count": k, "rows": {}, "invalid": {}, "skipped": {"count": 0, "examples": []}})

    write(1, "fp")
    write(2, "fp")
    write(3, "other")  # another model / data / selection: never used
    os.makedirs(f"{base}/ckpt-000004")  # cut short before its manifest
    uri, meta = latest_checkpoint(base, "fp")
    assert uri.endswith("ckpt-000002") and meta["done"] == [0, 1]
    assert latest_checkpoint(base, "nope") is None
    with pytest.raises(ValueError, match="checkpoint_every_s must be >= 0"):
        SubnetConfig(subnet_size=3, checkpoint_every_s=-1.0)
    with pytest.raises(ConfigError, match="subnet_checkpoint_s"):
        load_config("smoke", ["posterior.methods=[subnet]", "posterior.subnet_checkpoint_s=-5"])
