"""The run configuration: one tree of frozen dataclasses, each field written once.

Every setting is one line here: ``name: type = setting(default, help, range=... / choices=...)``
(:mod:`pipelines.config.settings`); a section checks its fields when it is built, the stage
fingerprints are taken from the fields, ``infoform config --list`` prints them. The runtime
classes of the stages subclass their sections (:class:`pipelines.passes.curvature.CurvatureConfig`,
:class:`pipelines.evaluation.runtime.EvalConfig`, ``SearchConfig``). Loaded from YAML presets
and ``--set`` overrides by :mod:`pipelines.config.load`; unknown keys, wrong types and values
out of range raise :class:`ConfigError` (a ``ValueError``) with one line naming the key.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

from laplace_core.curvature.layer_selection import check_selection
from laplace_core.names import (DEFAULT_ECE_BINS, DTYPE_NAMES, ECE_STRATEGIES, ENTROPY_BINS, FISHER_TYPES,
                                NORM_LAYER_MODES, PRECISION_NAMES, SELECTION_RULES)
from laplace_core.names import SUBNET_FISHER_TYPES as SUBNET_FISHERS
from laplace_core.posteriors.methods import method_names
from pipelines.config.settings import Checked, setting
from pipelines.config.choices import CORRUPTION_NAMES, IMAGENET_C_NAMES, PRED_TYPES, SEVERITIES, check_corruption

__all__ = [
    "ConfigError",
    "DTYPE_NAMES",
    "OBJECTIVES",
    "SCHEDULERS",
    "ALGORITHMS",
    "SUBNET_FISHER_TYPES",
    "ModelSpec",
    "OOD_GROUPS",
    "OODSetSpec",
    "DataSpec",
    "StorageSpec",
    "CurvatureSpec",
    "PosteriorSpec",
    "SearchSpec",
    "MethodRange",
    "ShiftSpec",
    "ActorSpec",
    "EvalSpec",
    "ScheduleSpec",
    "method_range_entry",
    "RunConfig",
    "STAGES",
    "METHOD_NAMES",
]

STAGES = ("curvature", "posterior", "search", "evaluate", "report")
METHOD_NAMES = method_names()  # laplace_core.posteriors.methods: the one method registry
#: ``posterior.subnet_fisher``: ``auto`` (GGN for <= 10 classes, else ``curvature.fisher``) or a
#: subnet Fisher of :mod:`laplace_core.posteriors.subnet`.
SUBNET_FISHER_TYPES = ("auto", *SUBNET_FISHERS)
#: ``search.objective`` values.
OBJECTIVES: dict[str, str] = {
    "nll": "smallest validation NLL",
    "ece": "smallest validation ECE among configurations with accuracy >= accuracy_floor",
}
#: ``search.scheduler`` values (``pipelines.evaluation.tune``).
SCHEDULERS: dict[str, str] = {"none": "every configuration on the whole split",
                              "asha": "ASHA: stop bad configurations after a chunk, 1/reduction_factor go on"}
#: ``search.algorithm`` values (``pipelines.evaluation.tune``).
ALGORITHMS: dict[str, str] = {"random": "the seeded uniform draws of sample_configs (Lee et al. 2020)",
                              "tpe": "Optuna's TPE sampler, seeded"}

ANY = "(-inf, inf)"  # any finite number
POSITIVE = "(0, inf)"
NON_NEGATIVE = "[0, inf)"
COUNT = "[1, inf)"


class ConfigError(ValueError):
    """A configuration problem, stated in one line."""


@dataclass(frozen=True)
class ModelSpec(Checked):
    """A torchvision classifier (``resnet50``, ``densenet121``, ... or ``demo_cnn``), or a
    model of one's own as ``package.module:callable`` (any importable callable returning an
    ``nn.Module``), and its weights: a local/remote state-dict file, a torchvision weights
    enum name, or ``None`` (``demo_cnn``: trained on the spot on the demo data; a factory:
    the model as it returns it)."""

    name: str = setting("resnet50", "torchvision name, demo_cnn, timm:NAME (timm's registry, pip install "
                                    "'infoform[timm]') or package.module:callable")
    weights: str | None = setting(None, "state-dict file (local or s3://) or torchvision weights enum name")
    num_classes: int | None = setting(None, "classes of the head (null: those found in the data)", range=COUNT)


#: ``data.ood[].group`` values (OpenOOD v1.5's groups; null: a set in no group).
OOD_GROUPS = ("near", "far")
_OOD_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*$")


@dataclass(frozen=True)
class OODSetSpec(Checked):
    """One named OOD set (``data.ood`` entry): ``{name, uri, group, limit}``, or the text
    ``NAME=URI`` / ``URI`` (named after its folder) as ``--ood`` writes it."""

    uri: str = setting(None, "OOD image folder (local or s3://)")
    name: str | None = setting(None, "the set's name in the report, metrics and history (null: its folder's name)")
    group: str | None = setting(None, "near, far or null: the group whose mean includes this set",
                                choices=OOD_GROUPS)
    limit: int | None = setting(None, "at most this many images of this set (null: data.ood_limit)", range=COUNT)

    @classmethod
    def from_text(cls, text: str) -> "OODSetSpec":
        """``NAME=URI`` or a bare ``URI`` (named after its last folder)."""
        head, sep, tail = str(text).partition("=")
        if sep and "/" not in head and ":" not in head:  # NAME=URI (a path's '=' comes after a '/')
            return cls(uri=tail.strip(), name=head.strip())
        return cls(uri=str(text).strip())

    def _check(self) -> None:
        if not isinstance(self.uri, str) or not self.uri.strip():
            raise ValueError(f"uri: an OOD set needs a folder (NAME=URI), got {self.uri!r}")
        if self.name is None:
            folder = self.uri.rstrip("/").rsplit("/", 1)[-1]
            object.__setattr__(self, "name", re.sub(r"[^A-Za-z0-9_-]", "_", folder).lstrip("_-") or "ood")
        if not _OOD_NAME.match(self.name):
            raise ValueError(f"name: OOD set name {self.name!r} must be letters, digits, _ or - (NAME=URI)")
        if self.name in OOD_GROUPS:
            raise ValueError(f"name: {self.name!r} names an OOD group; call the set something else")


@dataclass(frozen=True)
class DataSpec(Checked):
    """Where the images are. ``root`` holds ``train/``, ``val/`` (folders, or flat files +
    ``labels_csv``) and optionally ``test/``; ``ood`` lists the named OOD sets (:class:`OODSetSpec`;
    a single folder string is a one-element list). ``demo: true`` writes and uses the bundled demo data."""

    root: str | None = setting(None, "dataset root (local or s3://)")
    train_split: str = setting("train", "split folder for the curvature passes")
    val_split: str = setting("val", "split folder for the (N, tau) search")
    test_split: str | None = setting(None, "split folder for the evaluation (null: the val split)")
    labels_csv: str | None = setting(None, "LOC_val_solution.csv-style labels for a flat val folder")
    ood: tuple[OODSetSpec, ...] = setting((), "OOD sets: [{name, uri, group: near|far|null, limit}], NAME=URI "
                                          "or a folder (named after it); --ood NAME=URI, repeatable")
    demo: bool = setting(False, "write and use the bundled demo data")
    image_size: int = setting(224, "center crop (pixels)", range=COUNT)
    resize_size: int = setting(256, "shorter-side resize before the crop (pixels)", range=COUNT)
    limit: int | None = setting(None, "at most this many training images (class-balanced)", range=COUNT)
    per_class: int | None = setting(None, "at most this many training images per class", range=COUNT)
    val_limit: int | None = setting(None, "at most this many search images", range=COUNT)
    test_limit: int | None = setting(None, "at most this many test images", range=COUNT)
    ood_limit: int | None = setting(None, "at most this many OOD images", range=COUNT)
    partition_size: int = setting(20_000, "training images per partition (the unit of work and resume)", range=COUNT)
    mean: tuple[float, float, float] | None = setting(
        None, "per-channel mean of (x/255 - mean) / std (null: ImageNet's, or the demo's own)", range=ANY)
    std: tuple[float, float, float] | None = setting(None, "per-channel std of the normalisation (null: as mean)",
                                                     range=POSITIVE)
    decode_batch_size: int = setting(128, "images per Ray Data decode task batch", range=COUNT)
    decode_num_cpus: float = setting(1.0, "CPUs per Ray Data decode task", range=POSITIVE)
    extensions: tuple[str, ...] = setting((), "file suffixes indexed as images besides .jpg .jpeg .png .bmp .gif "
                                          ".webp .tif .tiff (e.g. [.jpe])")
    relist: bool = setting(False, "list the splits again instead of reusing the index under <output>/index/ "
                                  "(--relist)", fingerprint=False)

    def _check(self) -> None:
        names = [o.name for o in self.ood]
        dup = next((n for n in names if names.count(n) > 1), None)
        if dup is not None:
            raise ValueError(f"ood: the OOD set name {dup!r} is given twice; name each set once (NAME=URI)")
        bad = [e for e in self.extensions if not (isinstance(e, str) and e.startswith(".")
                                                   and e[1:].replace("_", "").isalnum())]
        if bad:
            raise ValueError(f"extensions must be file suffixes such as .jpe, got {bad[0]!r}")
        whole, tv = self.image_size, round(self.image_size / 0.875)
        if self.resize_size < self.image_size:
            raise ValueError(f"resize_size {self.resize_size} is smaller than image_size {self.image_size}: the center "
                             f"crop would pad every image with black; set data.resize_size to {whole} (the whole image) "
                             f"or {tv} (torchvision's 0.875 crop)")
        if self.image_size < self.resize_size / 2:  # ImageNet's eval crop is 0.875; under a half is a slip
            raise ValueError(f"image_size {self.image_size} with resize_size {self.resize_size} keeps the central "
                             f"{self.image_size / self.resize_size:.0%} of each side; set data.resize_size too: "
                             f"{whole} (the whole image) or {tv} (torchvision's 0.875 crop)")


@dataclass(frozen=True)
class StorageSpec(Checked):
    """How every process reaches the store behind ``s3://`` URIs (data, OOD, weights, output):
    ``endpoint_url`` for S3-compatible stores (MinIO, Ceph, R2, ...; ``--endpoint-url``; when
    unset, ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL`` of the submitting process), and
    ``options``, any further s3fs keyword arguments (e.g. ``{config_kwargs: {s3:
    {addressing_style: path}}}``). Resolved once on the driver and passed explicitly to every
    Train worker, Ray Data task and actor. Credentials never go here: the AWS chain supplies them.
    ``shared_fs``: local paths (output, data, OOD, weights) are on a filesystem that every node
    of a multi-node cluster mounts at the same place; without it such paths are refused there
    (:mod:`pipelines.distributed.cluster`). ``allow_download``: a torchvision weights name (e.g.
    ``ResNet50_Weights.IMAGENET1K_V1``) whose file is not in the driver's torch hub cache is
    refused in preflight unless this is set, since every node would download it and clusters
    often have no internet access. ``keep_stats``: keep ``stats/reduced`` (and the subnet pass's
    Fisher) after the posterior stage. On by default: they are what a changed posterior setting
    (``posterior.rank``, a new method, ``n_data``) rebuilds from in seconds, where without them the
    curvature stage, the run's most expensive one, would have to run again; ``false`` drops them
    once the posteriors are written (the eigenbasis stays: the kfac/efb posteriors reference it)."""

    endpoint_url: str | None = setting(None, "S3-compatible endpoint (null: AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL)")
    options: dict[str, Any] = setting(help="further s3fs keyword arguments", factory=dict)
    shared_fs: bool = setting(False, "local paths are on a filesystem every node mounts at the same place")
    allow_download: bool = setting(False, "torchvision weights names not in the local cache may be downloaded")
    keep_stats: bool = setting(True, "keep stats/reduced after the posterior stage (a changed posterior setting "
                                     "rebuilds from it); false drops it", fingerprint=False)

    def _check(self) -> None:
        self.resolved()

    def resolved(self):
        """The store settings every process uses (:class:`pipelines.storage.uris.StorageOptions`),
        the endpoint filled in from this process's environment when the config names none."""
        from pipelines.storage.uris import StorageOptions

        return StorageOptions(self.endpoint_url, dict(self.options)).resolved()


@dataclass(frozen=True)
class CurvatureSpec(Checked):
    """The curvature passes on Ray Train (:mod:`pipelines.passes.curvature`)."""

    num_workers: int = setting(2, "Ray Train workers", range=COUNT)
    cpus_per_worker: float = setting(0.5, "CPUs per worker (0.5 leaves Ray Data a CPU on a 2-core machine)",
                                     range=POSITIVE)
    use_gpu: bool | None = setting(None, "GPUs for the workers (null: when the cluster has any)")
    fisher: str = setting("mc", "mc: labels drawn from the model; empirical: the true labels", choices=FISHER_TYPES)
    mc_samples: int = setting(1, "label draws per image (fisher=mc)", range=COUNT)
    batch_size: int = setting(32, "images per forward/backward pass", range=COUNT)
    efb_fraction: float = setting(1.0, "share of the partitions the EFB pass reads", range="(0, 1]")
    max_failures: int = setting(2, "worker group restarts (-1: unlimited)", range="[-1, inf)", fingerprint=False)
    seed: int = setting(0, "seed of the MC labels", range=NON_NEGATIVE)
    torch_threads: int = setting(1, "intra-op threads per worker", range=COUNT)
    checkpoint_every_s: float | None = setting(
        600.0, "all-reduce + checkpoint this often (0: every partition; null: at the end)", range=NON_NEGATIVE,
        fingerprint=False)
    gpus_per_worker: float = setting(1.0, "GPUs per Train worker when use_gpu", range=POSITIVE, fingerprint=False)
    efb_max_examples: int | None = setting(None, "cap on the EFB pass's examples (after efb_fraction)", range=COUNT)
    model_dtype: str = setting("float32", "the model's dtype in the passes (float64 for dense checks)",
                               choices=DTYPE_NAMES)
    stats_dtype: str = setting("float64", "the dtype of the summed statistics", choices=DTYPE_NAMES)
    precision: str = setting("fp32", "passes 1-2 forward/backward under autocast in this precision (the sums stay "
                                     "float64)", choices=PRECISION_NAMES)
    bucket_mb: float = setting(64.0, "all-reduce bucket size (MiB)", range=POSITIVE, fingerprint=False)
    log_every_s: float = setting(30.0, "progress line interval (seconds), as evaluate.log_every_s", range=POSITIVE,
                                 fingerprint=False)


@dataclass(frozen=True)
class PosteriorSpec(Checked):
    """The posteriors built from the statistics (:mod:`pipelines.passes.posterior`)."""

    methods: tuple[str, ...] = setting(("diag", "kfac", "efb", "inf"), "posterior methods (and temperature)",
                                       choices=METHOD_NAMES, item="method")
    rank: int | None = setting(100, "INF rank K (null: full rank)", range=COUNT)
    prior_precision: float = setting(1.0, "prior precision tau before the search", range=POSITIVE)
    n_data: float | None = setting(None, "N before the search (null: the images seen)", range=POSITIVE)
    subnet_size: int = setting(10_000, "S, capped at the weights of all curvature layers", range=COUNT)
    subnet_fisher: str = setting("auto", "auto: GGN for <= 10 classes, else curvature.fisher",
                                 choices=SUBNET_FISHER_TYPES)
    subnet_rule: str = setting("wasserstein", "subnetwork selection (wasserstein_live skips dead units)",
                               choices=SELECTION_RULES)
    subnet_memory_gb: float = setting(4.0, "budget for the S x S float64 Fisher, checked before any cluster work",
                                      range=POSITIVE, fingerprint=False)
    subnet_checkpoint_s: float | None = setting(
        600.0, "save the running S x S sum after a partition this often (0: each; null: never)",
        range=NON_NEGATIVE, fingerprint=False)
    norm_layers: str = setting("map", "map: normalisation layers stay at MAP; diag: a diagonal block for them",
                               choices=NORM_LAYER_MODES)
    layers: str | tuple[str, ...] = setting(
        "all", "layers under the posterior: all, last, or a list of names / globs (the others stay at MAP)")

    def _check(self) -> None:
        check_selection(self.layers)
        if "subnet" in self.methods:  # S^2 float64 numbers must fit: fail before any cluster work
            try:
                from laplace_core.curvature.subnet_fisher import check_subnet_memory  # torch: subnet runs only

                check_subnet_memory(self.subnet_size, int(self.subnet_memory_gb * 2**30))
            except ValueError as e:
                raise ValueError(f"subnet_size: {e} (or raise posterior.subnet_memory_gb)") from None


@dataclass(frozen=True)
class MethodRange(Checked):
    """One method's own search ranges (``search.method_ranges`` entry); null keeps the common
    ``search.log10_n`` / ``search.log10_tau``. Ritter's KFAC prior, ``(√N A/M + √τ I) ⊗
    (√N G/M + √τ I)``, regularises differently from ``N F/M + τ I`` at the same ``(N, τ)``,
    so its best ``τ`` can lie elsewhere."""

    method: str = setting(dataclasses.MISSING, "the method (one of posterior's methods)")
    log10_n: tuple[float, float] | None = setting(None, "its log10 N range (null: search.log10_n)", range=ANY)
    log10_tau: tuple[float, float] | None = setting(None, "its log10 tau range (null: search.log10_tau)",
                                                    range=ANY)


def method_range_entry(entry: Any) -> tuple[Any, Any, Any]:
    """``(method, log10_n, log10_tau)`` of a :class:`MethodRange` or such a tuple."""
    if isinstance(entry, MethodRange):
        return entry.method, entry.log10_n, entry.log10_tau
    try:
        method, range_n, range_tau = entry
    except (TypeError, ValueError):
        raise ValueError(f"method_ranges entries must be (method, log10_n, log10_tau), got {entry!r}") from None
    return method, range_n, range_tau


@dataclass(frozen=True)
class SearchSpec(Checked):
    """The (N, tau) search (:mod:`pipelines.evaluation.search`); its actors are ``evaluate``'s
    (``concurrent_trials`` of them at once)."""

    num_configs: int = setting(100, "configurations drawn", range=COUNT)
    log10_n: tuple[float, float] = setting((0.0, 8.0), "log10 N range (low, high)", range=ANY)
    log10_tau: tuple[float, float] = setting((-4.0, 4.0), "log10 tau range (low, high)", range=ANY)
    objective: str = setting("nll", "what the search minimises", choices=OBJECTIVES)
    accuracy_floor: float | None = setting(None, "minimum validation accuracy for objective=ece", range="[0, 1]")
    mc_samples: int = setting(10, "weight samples K per configuration", range=COUNT)
    seed: int = setting(0, "seed of the draws and the samples", range=NON_NEGATIVE)
    method_ranges: tuple[MethodRange, ...] = setting((), "per-method ranges, e.g. [{method: kfac, log10_tau: [-2, 6]}]")
    chunk_size: int = setting(4096, "examples per configuration and group of weight samples; ASHA's step",
                              range=COUNT, fingerprint=False)
    scheduler: str = setting("none", "none: every configuration on the whole split; asha: stop bad ones early",
                             choices=SCHEDULERS)
    algorithm: str = setting("random", "random: the seeded draws (Lee et al. 2020); tpe: Optuna's TPE",
                             choices=ALGORITHMS)
    reduction_factor: int = setting(4, "ASHA: 1 in reduction_factor configurations goes on at each rung",
                                    range="[2, inf)")
    map_limit_log10_tau: float | None = setting(
        None, "adds the MAP-limit configuration (log10 N at the top of the method's range, this log10 tau; "
              "8: the predictive is MAP's within MC noise) to every method's search; null: none", range=ANY)
    concurrent_trials: int | None = setting(
        None, "trials at once, each on its own actor (null: evaluate.num_actors); 1 where a trial takes less than "
              "an actor's start (a one-chunk split of a small model): Tune then starts an actor per trial and "
              "drops it before it runs", range=COUNT)
    pred_types: tuple[str, ...] | None = setting(
        None, "predictives searched per method (nn: weight sampling, glm: linearised); each method's is chosen "
              "on the validation objective and evaluated on test; null: evaluate.pred_type alone",
        choices=PRED_TYPES, item="predictive")

    def _check(self) -> None:
        if self.pred_types is not None and (not self.pred_types or len(set(self.pred_types)) != len(self.pred_types)):
            raise ValueError(f"pred_types must list each predictive once (or null), got {list(self.pred_types)}")
        for name in ("log10_n", "log10_tau"):
            low, high = getattr(self, name)
            if not low <= high:
                raise ValueError(f"{name} must be finite with low <= high, got {getattr(self, name)!r}")
        seen = set()
        for entry in self.method_ranges:
            method, *ranges = method_range_entry(entry)
            if method not in METHOD_NAMES:
                raise ValueError(f"method_ranges: unknown method {method!r}; valid: {', '.join(METHOD_NAMES)}")
            if method in seen:
                raise ValueError(f"method_ranges: {method!r} appears twice")
            seen.add(method)
            for name, low_high in zip(("log10_n", "log10_tau"), ranges):
                if low_high is not None and not low_high[0] <= low_high[1]:
                    raise ValueError(f"method_ranges[{method}].{name} must be finite with low <= high, "
                                     f"got {list(low_high)}")


@dataclass(frozen=True)
class ShiftSpec(Checked):
    """The distribution-shift sweep (:mod:`pipelines.evaluation.shift`): the test split under
    each ImageNet-C-style corruption (:data:`pipelines.ingest.corruptions.CORRUPTIONS`) at each
    severity (1..5), every method evaluated on it."""

    corruptions: tuple[str, ...] = setting(IMAGENET_C_NAMES, "corruptions of the test split (default: ImageNet-C's 15)",
                                           choices=CORRUPTION_NAMES, item="corruption")
    severities: tuple[int, ...] = setting(SEVERITIES, "severities, each one of 1..5")

    def _check(self) -> None:
        if not self.corruptions or not self.severities:
            raise ValueError("needs at least one corruption and one severity (or null: no sweep)")
        for severity in self.severities:
            try:
                check_corruption(self.corruptions[0], severity)
            except ValueError as e:
                raise ValueError(f"severities: {e}") from None
        if len(set(self.corruptions)) != len(self.corruptions) or len(set(self.severities)) != len(self.severities):
            raise ValueError("a corruption or severity is listed twice")


@dataclass(frozen=True)
class ActorSpec(Checked):
    """The search and evaluation actors (``evaluate`` keys; the search uses them too)."""

    num_actors: int = setting(2, "Ray actors of the search and the evaluation", range=COUNT)
    batch_size: int = setting(64, "rows per forward pass", range=COUNT)
    chunk_size: int = setting(1024, "examples per group of weight samples (a draw is amortised over the chunk)",
                              range=COUNT, fingerprint=False)
    cpus_per_actor: float = setting(0.5, "Ray CPUs per actor (its torch threads: max(1, round(cpus)))",
                                    range=NON_NEGATIVE, fingerprint=False)
    gpus_per_actor: float | None = setting(None, "null: 1, or 1/k so that every actor fits the cluster's GPUs",
                                           range=NON_NEGATIVE, fingerprint=False)
    torch_threads: int | None = setting(None, "intra-op threads per actor (null: max(1, round(cpus_per_actor)))",
                                        range=COUNT, fingerprint=False)
    dtype: str = setting("float32", "the actors' model and input dtype (float64 for exact checks)", choices=DTYPE_NAMES)
    precision: str = setting("fp32", "the actors' forwards (search, evaluation, scoring) under autocast in this "
                                     "precision (pred_type nn); draws formed outside it, metrics in float64", choices=PRECISION_NAMES)
    max_failures: int = setting(2, "the actors' round starts again this often when an actor dies",
                                range=NON_NEGATIVE, fingerprint=False)
    log_every_s: float = setting(30.0, "progress line interval of the actors (seconds)", range=POSITIVE,
                                 fingerprint=False)
    placement_timeout_s: float = setting(900.0, "actors not placed by then end the stage (seconds)",
                                         range=POSITIVE, fingerprint=False)
    stall_timeout_s: float = setting(300.0, "a round whose actors all wait for data, no batch read for this long, "
                                     "ends in one line naming what waits for what (seconds)",
                                     range=POSITIVE, fingerprint=False)
    pred_type: str = setting("nn", "nn: weight sampling; glm: linearised predictive", choices=PRED_TYPES)
    ece_mode: str = setting("equal_width", "the headline ECE's binning (both are computed)", choices=ECE_STRATEGIES)
    ece_bins: int = setting(DEFAULT_ECE_BINS, "bins of the headline ECE", range=COUNT)

    def _check(self) -> None:
        if self.precision != "fp32" and self.dtype != "float32":
            raise ValueError(f"precision {self.precision} runs a float32 model under autocast; dtype is {self.dtype}")
        if self.precision != "fp32" and self.pred_type != "nn":
            raise ValueError(f"precision {self.precision} applies to pred_type nn; pred_type glm (Jacobian-vector "
                             "products, the closed-form last layer) runs in fp32")
        if self.gpus_per_actor is not None:
            from pipelines.config.choices import check_gpu_request

            why = check_gpu_request(self.gpus_per_actor)
            if why:
                raise ValueError(f"gpus_per_actor: {why}")


@dataclass(frozen=True)
class EvalSpec(ActorSpec):
    """The evaluation of MAP and every posterior on the test split and the OOD set."""

    mc_samples: int = setting(30, "weight samples K", range=COUNT)
    seed: int = setting(0, "run seed (sample t uses sample_seed(seed, t))", range=NON_NEGATIVE)
    sample_cache_mb: float = setting(256.0, "keep a method's K weight samples in memory when they fit (MiB)",
                                     range=NON_NEGATIVE, fingerprint=False)
    entropy_bins: int = setting(ENTROPY_BINS, "histogram bins of the predictive entropies", range=COUNT)
    ood_exact_limit: int = setting(0, "keep raw OOD scores (exact AUROC) while in + out examples <= this",
                                   range=NON_NEGATIVE)
    bootstrap: int = setting(1000, "paired bootstrap resamples over test images behind every interval (seeded by "
                                   "seed)", range="[2, inf)")
    shift: ShiftSpec | None = setting(None, "e.g. {corruptions: [gaussian_noise, contrast], severities: [1, 3, 5]}")


@dataclass(frozen=True)
class ScheduleSpec(Checked):
    """Scheduled audits (docs/scheduled-audits.md, :mod:`pipelines.cli.reuse`, :mod:`pipelines.report.history`,
    :mod:`pipelines.cli.alerts`): reuse an earlier run's fitted stages, append to a history, alert."""

    reuse: str = setting("auto", "an earlier run's output URI whose curvature, posteriors and search this run reads in "
                                 "place; auto: the newest matching run under schedule.history; none: compute them",
                         fingerprint=False)
    history: str | None = setting(None, "the audit root: each run writes its rows as its own object under <history>/history/ and "
                                        "auto reuse looks at the runs in its sub-folders (null: neither)",
                                  fingerprint=False)
    alert: tuple[str, ...] = setting((), "rules like ece>0.05, accuracy<0.70 or inf.ood_auroc<0.8: a rule that "
                                         "fires writes <output>/alerts.json and the job exits with code 3",
                                     item="rule", fingerprint=False)


@dataclass(frozen=True)
class RunConfig(Checked):
    preset: str = setting("custom", "the preset's name")
    description: str = setting("", "one line on what the preset is for")
    output: str = setting("runs/default", "output URI (local path or s3://bucket/prefix)")
    model: ModelSpec = setting(help="the classifier", factory=ModelSpec)
    models: tuple[ModelSpec, ...] = setting((), "several models, each its own run under output/<name>")
    data: DataSpec = setting(help="the images", factory=DataSpec)
    storage: StorageSpec = setting(help="the store behind s3:// URIs", factory=StorageSpec)
    curvature: CurvatureSpec = setting(help="the curvature passes", factory=CurvatureSpec)
    posterior: PosteriorSpec = setting(help="the posteriors", factory=PosteriorSpec)
    search: SearchSpec = setting(help="the (N, tau) search", factory=SearchSpec)
    evaluate: EvalSpec = setting(help="the evaluation and the actors", factory=EvalSpec)
    schedule: ScheduleSpec = setting(help="scheduled audits: reuse, history, alerts", factory=ScheduleSpec)
    stages: tuple[str, ...] = setting(STAGES, "stages to run", choices=STAGES, item="stage")
    force: tuple[str, ...] = setting((), "stages to redo even when their artifacts exist", choices=STAGES,
                                     item="stage")

    def validate(self) -> "RunConfig":
        """What needs the whole tree (each section checked itself when it was built)."""
        if not self.data.demo and not self.data.root:
            raise ConfigError("data.root is required (or use --preset demo)")
        return self

    def storage_options(self):
        """The store settings every process uses (:meth:`StorageSpec.resolved`)."""
        return self.storage.resolved()

    def all_models(self) -> tuple[ModelSpec, ...]:
        return self.models if self.models else (self.model,)
