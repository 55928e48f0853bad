"""The run configuration: one tree of frozen dataclasses, validated in :meth:`RunConfig.validate`.

Loaded from YAML presets and ``--set`` overrides by :mod:`pipelines.config.load`; each
stage's runtime settings are derived from its section mechanically
(:func:`pipelines.config.load.derive`). Unknown keys, wrong types and unknown enum values
raise :class:`ConfigError` (a ``ValueError``) with one line naming the key and what is valid.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from laplace_core.batch_loop import PRECISIONS
from laplace_core.methods import method_names

__all__ = [
    "ConfigError",
    "ModelSpec",
    "DataSpec",
    "StorageSpec",
    "CurvatureSpec",
    "PosteriorSpec",
    "SearchSpec",
    "MethodRange",
    "ShiftSpec",
    "EvalSpec",
    "RunConfig",
    "STAGES",
    "METHOD_NAMES",
]

STAGES = ("curvature", "posterior", "search", "evaluate", "report")
METHOD_NAMES = method_names()  # laplace_core.methods: the one method registry
FISHER_TYPES = ("mc", "empirical")
OBJECTIVES = ("nll", "ece")
PRED_TYPES = ("nn", "glm")
SUBNET_FISHER_TYPES = ("auto", "mc", "empirical", "ggn")
DTYPES = ("float32", "float64")


class ConfigError(ValueError):
    """A configuration problem, stated in one line."""


@dataclass(frozen=True)
class ModelSpec:
    """A torchvision classifier (``resnet50``, ``densenet121``, ... or ``demo_cnn``), or a
    model of one's own as ``package.module:callable`` (any importable callable returning an
    ``nn.Module``), and its weights: a local/remote state-dict file, a torchvision weights
    enum name, or ``None`` (``demo_cnn``: trained on the spot on the demo data; a factory:
    the model as it returns it)."""

    name: str = "resnet50"
    weights: str | None = None
    num_classes: int | None = None


@dataclass(frozen=True)
class DataSpec:
    """Where the images are. ``root`` holds ``train/``, ``val/`` (folders, or flat files +
    ``labels_csv``) and optionally ``test/``; ``ood`` is an image folder of
    out-of-distribution images. ``demo: true`` writes and uses the bundled demo data.
    ``mean`` / ``std``: the per-channel input normalisation ``(x/255 − mean) / std`` of the
    eval transform (null: ImageNet's, or the demo's own for the demo data)."""

    root: str | None = None
    train_split: str = "train"
    val_split: str = "val"
    test_split: str | None = None
    labels_csv: str | None = None
    ood: str | None = None
    demo: bool = False
    image_size: int = 224
    resize_size: int = 256
    limit: int | None = None
    per_class: int | None = None
    val_limit: int | None = None
    test_limit: int | None = None
    ood_limit: int | None = None
    partition_size: int = 20_000
    mean: tuple[float, float, float] | None = None
    std: tuple[float, float, float] | None = None
    decode_batch_size: int = 128  # images per Ray Data decode task batch
    decode_num_cpus: float = 1.0  # CPUs per Ray Data decode task


@dataclass(frozen=True)
class StorageSpec:
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
    often have no internet access."""

    endpoint_url: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    shared_fs: bool = False  # local paths are on a filesystem every node mounts at the same place
    allow_download: bool = False  # torchvision weights names not in the local cache may be downloaded by each node


@dataclass(frozen=True)
class CurvatureSpec:
    num_workers: int = 2
    cpus_per_worker: float = 0.5
    use_gpu: bool | None = None
    fisher: str = "mc"
    mc_samples: int = 1
    batch_size: int = 32
    efb_fraction: float = 1.0
    max_failures: int = 2
    seed: int = 0
    torch_threads: int | None = None
    checkpoint_every_s: float | None = 600.0  # all-reduce + checkpoint this often (0: every partition; null: at the end)
    gpus_per_worker: float = 1.0  # GPUs per Train worker when use_gpu
    efb_max_examples: int | None = None  # cap on the EFB pass's examples (after efb_fraction)
    model_dtype: str = "float32"  # the model's dtype in the passes (float64 for dense checks)
    stats_dtype: str = "float64"  # the dtype of the summed statistics
    precision: str = "fp32"  # fp32 | bf16 | fp16: passes 1-2 forward/backward under autocast (sums stay float64)
    bucket_mb: float = 64.0  # all-reduce bucket size (MiB)
    log_every_s: float = 10.0  # progress line interval (seconds)


@dataclass(frozen=True)
class PosteriorSpec:
    methods: tuple[str, ...] = ("diag", "kfac", "efb", "inf")
    rank: int | None = 100
    prior_precision: float = 1.0
    n_data: float | None = None
    subnet_size: int = 10_000  # S, capped at the weights of all curvature layers (D_total)
    subnet_fisher: str = "auto"  # auto (GGN for <= 10 classes, else curvature.fisher), mc, empirical, ggn
    subnet_rule: str = "wasserstein"  # laplace_core.subnet.SELECTION_RULES; wasserstein_live skips dead units
    subnet_memory_gb: float = 4.0  # budget for the S x S float64 Fisher, checked before any cluster work
    subnet_checkpoint_s: float | None = 600.0  # save the running S x S sum after a partition this often (0: each; None: never)
    norm_layers: str = "map"  # map: normalisation layers stay at MAP (the papers' protocol); diag: a diagonal block for them
    # which curvature layers carry the posterior: all, last (the last curvature layer, e.g. fc: last-layer
    # Laplace) or a list of layer names / globs (laplace_core.layer_selection); the others stay at MAP
    layers: str | tuple[str, ...] = "all"


@dataclass(frozen=True)
class MethodRange:
    """One method's own search ranges (``search.method_ranges`` entry); null keeps the common
    ``search.log10_n`` / ``search.log10_tau``. Ritter's KFAC prior, ``(√N A/M + √τ I) ⊗
    (√N G/M + √τ I)``, regularises differently from ``N F/M + τ I`` at the same ``(N, τ)``,
    so its best ``τ`` can lie elsewhere."""

    method: str
    log10_n: tuple[float, float] | None = None
    log10_tau: tuple[float, float] | None = None


@dataclass(frozen=True)
class SearchSpec:
    num_configs: int = 100
    log10_n: tuple[float, float] = (0.0, 8.0)
    log10_tau: tuple[float, float] = (-4.0, 4.0)
    objective: str = "nll"
    accuracy_floor: float | None = None
    mc_samples: int = 10
    seed: int = 0
    method_ranges: tuple[MethodRange, ...] = ()  # e.g. [{method: kfac, log10_tau: [-2, 6]}]
    chunk_size: int = 4096  # examples per re-targeted configuration and group of weight samples; ASHA's step
    scheduler: str = "none"  # none: every configuration on the whole split; asha: stop bad ones early (Ray Tune)
    algorithm: str = "random"  # random: the seeded draws (Lee et al. 2020); tpe: Optuna's TPE via Ray Tune
    reduction_factor: int = 4  # ASHA: 1 in reduction_factor configurations goes on at each rung


@dataclass(frozen=True)
class ShiftSpec:
    """The distribution-shift sweep (:mod:`pipelines.evaluation.shift`): the test split under
    each ImageNet-C-style corruption (:data:`pipelines.ingest.corruptions.CORRUPTIONS`) at each
    severity (1..5), every method evaluated on it."""

    corruptions: tuple[str, ...] = ("gaussian_noise", "gaussian_blur", "contrast", "brightness",
                                    "jpeg_compression", "pixelate")
    severities: tuple[int, ...] = (1, 2, 3, 4, 5)


@dataclass(frozen=True)
class EvalSpec:
    mc_samples: int = 30
    num_actors: int = 2
    batch_size: int = 64
    ece_bins: int = 15
    ece_mode: str = "equal_width"
    pred_type: str = "nn"
    seed: int = 0
    max_failures: int = 2  # the actors' round starts again this often when an actor dies (search and evaluation)
    cpus_per_actor: float = 0.5  # Ray CPUs per search/evaluation actor (its torch threads: max(1, round(cpus)))
    gpus_per_actor: float | None = None  # None: 1, or 1/k so that every actor fits the cluster's GPUs; 0 without
    placement_timeout_s: float = 900.0  # actors not placed by then (resources the cluster lacks) end the stage
    chunk_size: int = 1024  # examples per group of weight samples (a draw is amortised over the chunk)
    sample_cache_mb: float = 256.0  # keep a method's K weight samples in memory when they fit (MiB)
    dtype: str = "float32"  # the actors' model and input dtype (float64 for exact checks)
    torch_threads: int | None = None  # intra-op threads per actor (null: max(1, round(cpus_per_actor)))
    log_every_s: float = 30.0  # progress line interval of the actors (seconds)
    entropy_bins: int = 50  # histogram bins of the predictive entropies
    ood_exact_limit: int = 0  # keep raw OOD scores (exact AUROC) while in + out examples <= this
    shift: ShiftSpec | None = None  # e.g. {corruptions: [gaussian_noise, contrast], severities: [1, 3, 5]}


@dataclass(frozen=True)
class RunConfig:
    preset: str = "custom"
    description: str = ""
    output: str = "runs/default"
    model: ModelSpec = field(default_factory=ModelSpec)
    models: tuple[ModelSpec, ...] = ()
    data: DataSpec = field(default_factory=DataSpec)
    storage: StorageSpec = field(default_factory=StorageSpec)
    curvature: CurvatureSpec = field(default_factory=CurvatureSpec)
    posterior: PosteriorSpec = field(default_factory=PosteriorSpec)
    search: SearchSpec = field(default_factory=SearchSpec)
    evaluate: EvalSpec = field(default_factory=EvalSpec)
    stages: tuple[str, ...] = STAGES
    force: tuple[str, ...] = ()

    def validate(self) -> "RunConfig":
        for m in self.posterior.methods:
            if m not in METHOD_NAMES:
                raise ConfigError(f"unknown method {m!r}; valid: {', '.join(METHOD_NAMES)}")
        for s in (*self.stages, *self.force):
            if s not in STAGES:
                raise ConfigError(f"unknown stage {s!r}; valid: {', '.join(STAGES)}")
        if self.curvature.fisher not in FISHER_TYPES:
            raise ConfigError(f"unknown fisher {self.curvature.fisher!r}; valid: {', '.join(FISHER_TYPES)}")
        self._validate_method_ranges()
        if self.search.objective not in OBJECTIVES:
            raise ConfigError(f"unknown search objective {self.search.objective!r}; valid: {', '.join(OBJECTIVES)}")
        for key, v, valid in (("scheduler", self.search.scheduler, ("none", "asha")),
                              ("algorithm", self.search.algorithm, ("random", "tpe"))):
            if v not in valid:
                raise ConfigError(f"unknown search.{key} {v!r}; valid: {', '.join(valid)}")
        rf = self.search.reduction_factor
        if isinstance(rf, bool) or not isinstance(rf, int) or rf < 2:
            raise ConfigError(f"search.reduction_factor must be an int >= 2, got {rf!r}")
        if self.evaluate.pred_type not in PRED_TYPES:
            raise ConfigError(f"unknown pred_type {self.evaluate.pred_type!r}; valid: {', '.join(PRED_TYPES)}")
        if self.evaluate.ece_mode not in ("equal_width", "equal_mass"):
            raise ConfigError(f"unknown ece_mode {self.evaluate.ece_mode!r}; valid: equal_width, equal_mass")
        if not self.evaluate.cpus_per_actor >= 0:
            raise ConfigError("evaluate.cpus_per_actor must be >= 0")
        if self.evaluate.gpus_per_actor is not None and not self.evaluate.gpus_per_actor >= 0:
            raise ConfigError("evaluate.gpus_per_actor must be >= 0 (or null: one share of the cluster's GPUs)")
        if self.evaluate.gpus_per_actor is not None:
            from pipelines.distributed.cluster import check_gpu_request

            why = check_gpu_request(self.evaluate.gpus_per_actor)
            if why:
                raise ConfigError(f"evaluate.gpus_per_actor: {why}")
        if not self.evaluate.placement_timeout_s > 0:
            raise ConfigError("evaluate.placement_timeout_s must be > 0 (seconds)")
        if self.curvature.num_workers < 1:
            raise ConfigError("curvature.num_workers must be >= 1")
        if self.posterior.norm_layers not in ("map", "diag"):
            raise ConfigError(f"unknown posterior.norm_layers {self.posterior.norm_layers!r}; valid: map, diag")
        from laplace_core.layer_selection import check_selection

        try:
            check_selection(self.posterior.layers)
        except ValueError as e:
            raise ConfigError(f"posterior.{e}") from None
        if self.posterior.rank is not None and self.posterior.rank < 1:
            raise ConfigError("posterior.rank must be >= 1 (or null for full rank)")
        if "subnet" in self.posterior.methods:
            self._validate_subnet()
        if not (0 < self.curvature.efb_fraction <= 1):
            raise ConfigError("curvature.efb_fraction must be in (0, 1]")
        if self.curvature.checkpoint_every_s is not None and not self.curvature.checkpoint_every_s >= 0:
            raise ConfigError("curvature.checkpoint_every_s must be >= 0 (0: after every partition) or null (at the end)")
        self._validate_runtime()
        if self.evaluate.shift is not None:
            self._validate_shift(self.evaluate.shift)
        if self.data.std is not None and not all(v > 0 for v in self.data.std):
            raise ConfigError(f"data.std must be positive per channel, got {list(self.data.std)}")
        if not self.data.demo and not self.data.root:
            raise ConfigError("data.root is required (or use --preset demo)")
        try:
            self.storage_options()
        except ValueError as e:
            raise ConfigError(f"storage: {e}") from None
        return self

    def storage_options(self):
        """The store settings every process uses (:class:`pipelines.storage.uris.StorageOptions`),
        the endpoint filled in from this process's environment when the config names none."""
        from pipelines.storage.uris import StorageOptions

        return StorageOptions(self.storage.endpoint_url, dict(self.storage.options)).resolved()

    def _validate_runtime(self) -> None:
        c, d = self.curvature, self.data
        for name in ("model_dtype", "stats_dtype"):
            if getattr(c, name) not in DTYPES:
                raise ConfigError(f"unknown curvature.{name} {getattr(c, name)!r}; valid: {', '.join(DTYPES)}")
        if c.efb_max_examples is not None and c.efb_max_examples < 1:
            raise ConfigError("curvature.efb_max_examples must be >= 1 (or null: no cap)")
        if c.precision not in PRECISIONS:
            raise ConfigError(f"unknown curvature.precision {c.precision!r}; valid: {', '.join(PRECISIONS)}")
        for key, v in (("curvature.bucket_mb", c.bucket_mb), ("curvature.log_every_s", c.log_every_s),
                       ("curvature.gpus_per_worker", c.gpus_per_worker), ("data.decode_num_cpus", d.decode_num_cpus)):
            if not v > 0:
                raise ConfigError(f"{key} must be > 0, got {v!r}")
        if d.decode_batch_size < 1:
            raise ConfigError("data.decode_batch_size must be >= 1")
        ev = self.evaluate
        if ev.dtype not in DTYPES:
            raise ConfigError(f"unknown evaluate.dtype {ev.dtype!r}; valid: {', '.join(DTYPES)}")
        for key, v, low in (("evaluate.chunk_size", ev.chunk_size, 1), ("search.chunk_size", self.search.chunk_size, 1),
                            ("evaluate.entropy_bins", ev.entropy_bins, 1), ("evaluate.ood_exact_limit", ev.ood_exact_limit, 0),
                            ("evaluate.torch_threads", 1 if ev.torch_threads is None else ev.torch_threads, 1)):
            if v < low:
                raise ConfigError(f"{key} must be >= {low}, got {v!r}")
        if not (ev.sample_cache_mb >= 0 and ev.log_every_s > 0):
            raise ConfigError("evaluate.sample_cache_mb must be >= 0 and evaluate.log_every_s > 0")

    @staticmethod
    def _validate_shift(sh: ShiftSpec) -> None:
        from pipelines.ingest.corruptions import check_corruption

        if not sh.corruptions or not sh.severities:
            raise ConfigError("evaluate.shift needs at least one corruption and one severity (or null: no sweep)")
        for c in sh.corruptions:
            for v in sh.severities:
                try:
                    check_corruption(c, v)
                except ValueError as e:
                    raise ConfigError(f"evaluate.shift: {e}") from None
        if len(set(sh.corruptions)) != len(sh.corruptions) or len(set(sh.severities)) != len(sh.severities):
            raise ConfigError("evaluate.shift: a corruption or severity is listed twice")

    def _validate_method_ranges(self) -> None:
        seen = set()
        for r in self.search.method_ranges:
            if r.method not in METHOD_NAMES:
                raise ConfigError(f"search.method_ranges: unknown method {r.method!r}; valid: {', '.join(METHOD_NAMES)}")
            if r.method in seen:
                raise ConfigError(f"search.method_ranges: {r.method!r} appears twice")
            seen.add(r.method)
            for name in ("log10_n", "log10_tau"):
                lo_hi = getattr(r, name)
                if lo_hi is not None and not lo_hi[0] <= lo_hi[1]:
                    raise ConfigError(f"search.method_ranges[{r.method}].{name}: low must be <= high, got {list(lo_hi)}")

    def _validate_subnet(self) -> None:
        p = self.posterior
        if p.subnet_size < 1:
            raise ConfigError("posterior.subnet_size must be >= 1")
        if p.subnet_fisher not in SUBNET_FISHER_TYPES:
            raise ConfigError(f"unknown posterior.subnet_fisher {p.subnet_fisher!r}; valid: {', '.join(SUBNET_FISHER_TYPES)}")
        if not p.subnet_memory_gb > 0:
            raise ConfigError("posterior.subnet_memory_gb must be > 0")
        if p.subnet_checkpoint_s is not None and not p.subnet_checkpoint_s >= 0:
            raise ConfigError("posterior.subnet_checkpoint_s must be >= 0 (seconds) or null (never)")
        import torch

        from laplace_core.subnet import SELECTION_RULES, check_subnet_memory

        if p.subnet_rule not in SELECTION_RULES:
            raise ConfigError(f"unknown posterior.subnet_rule {p.subnet_rule!r}; valid: {', '.join(SELECTION_RULES)}")

        try:  # S^2 float64 numbers must fit: fail before any cluster work
            check_subnet_memory(p.subnet_size, int(p.subnet_memory_gb * 2**30), torch.float64)
        except ValueError as e:
            raise ConfigError(f"posterior.subnet_size: {e} (or raise posterior.subnet_memory_gb)") from None

    def all_models(self) -> tuple[ModelSpec, ...]:
        return self.models if self.models else (self.model,)
