"""Run configuration: one frozen dataclass tree, loaded from YAML presets with overrides.

A preset is a YAML file in ``configs/`` whose keys mirror :class:`RunConfig`. CLI
overrides are ``key.path=value`` strings (``--set curvature.num_workers=4``); values
are parsed as YAML scalars/lists and checked against the field's type. Unknown keys,
wrong types and unknown enum values raise :class:`ConfigError` (a ``ValueError``)
with one line naming the key and what is valid.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import yaml

__all__ = [
    "ConfigError",
    "ModelSpec",
    "DataSpec",
    "StorageSpec",
    "CurvatureSpec",
    "PosteriorSpec",
    "SearchSpec",
    "MethodRange",
    "EvalSpec",
    "RunConfig",
    "STAGES",
    "METHOD_NAMES",
    "PRESETS_DIR",
    "list_presets",
    "load_config",
    "from_dict",
    "to_dict",
    "apply_overrides",
]

PRESETS_DIR = Path(__file__).resolve().parent.parent.parent / "configs"
STAGES = ("curvature", "posterior", "search", "evaluate", "report")
METHOD_NAMES = ("diag", "kfac", "kfac_exact", "efb", "inf", "subnet")
FISHER_TYPES = ("mc", "empirical")
OBJECTIVES = ("nll", "ece")
PRED_TYPES = ("nn", "glm")
SUBNET_FISHER_TYPES = ("auto", "mc", "empirical", "ggn")


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
    chunk_size: int = 4096  # examples per re-targeted configuration and group of weight samples


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
        if self.posterior.rank is not None and self.posterior.rank < 1:
            raise ConfigError("posterior.rank must be >= 1 (or null for full rank)")
        if "subnet" in self.posterior.methods:
            self._validate_subnet()
        if not (0 < self.curvature.efb_fraction <= 1):
            raise ConfigError("curvature.efb_fraction must be in (0, 1]")
        if self.curvature.checkpoint_every_s is not None and not self.curvature.checkpoint_every_s >= 0:
            raise ConfigError("curvature.checkpoint_every_s must be >= 0 (0: after every partition) or null (at the end)")
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


# --------------------------------------------------------------------------- building
def _is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check/convert ``value`` to annotation ``tp`` (the subset used in this module)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{key}: cannot be null")
    if origin is tuple:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise ConfigError(f"{key}: expected {len(args)} values, got {len(value)}")
        return tuple(_coerce(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if origin is dict:
        if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
            raise ConfigError(f"{key}: expected a mapping with string keys, got {value!r}")
        return dict(value)
    if _is_dataclass_type(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return from_dict(tp, value, prefix=f"{key}.")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return str(value)
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{key}: unsupported type {tp!r}")  # pragma: no cover


def from_dict(cls: type, data: Mapping[str, Any], prefix: str = "") -> Any:
    """Build dataclass ``cls`` from a nested mapping; unknown keys raise ConfigError."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = [k for k in data if k not in names]
    if unknown:
        raise ConfigError(f"unknown key {prefix}{unknown[0]}; valid keys here: {', '.join(names)}")
    kwargs = {k: _coerce(v, hints[k], f"{prefix}{k}") for k, v in data.items()}
    return cls(**kwargs)


def to_dict(obj: Any) -> Any:
    """JSON/YAML-able nested dict of a config tree."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (tuple, list)):
        return [to_dict(v) for v in obj]
    return obj


def _set_path(tree: dict, path: str, value: Any) -> None:
    parts = path.split(".")
    node = tree
    for p in parts[:-1]:
        nxt = node.get(p)
        if nxt is None:
            nxt = {}
            node[p] = nxt
        if not isinstance(nxt, dict):
            raise ConfigError(f"cannot set {path}: {p} is not a section")
        node = nxt
    node[parts[-1]] = value


def apply_overrides(tree: dict, overrides: list[str]) -> dict:
    """Apply ``key.path=value`` overrides (values parsed as YAML) to a nested dict."""
    out = yaml.safe_load(yaml.safe_dump(tree))  # deep copy through plain types
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not key=value (e.g. curvature.num_workers=4)")
        key, raw = item.split("=", 1)
        key = key.strip()
        if not key:
            raise ConfigError(f"override {item!r} has an empty key")
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError:
            value = raw
        _set_path(out, key, value)
    return out


def list_presets() -> list[str]:
    return sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))


def _read_preset(name_or_path: str) -> dict:
    path = Path(name_or_path)
    if not (path.suffix in (".yaml", ".yml") and path.exists()):
        path = PRESETS_DIR / f"{name_or_path}.yaml"
    if not path.exists():
        raise ConfigError(f"unknown preset {name_or_path!r}; valid: {', '.join(list_presets())} (or a path to a .yaml file)")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"preset {path.name} does not parse{where}: {getattr(e, 'problem', e)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"preset {path.name} must be a mapping at the top level")
    data.setdefault("preset", path.stem)
    return data


def load_config(preset: str, overrides: list[str] | None = None) -> RunConfig:
    """Preset + ``key=value`` overrides -> validated, frozen :class:`RunConfig`."""
    tree = apply_overrides(_read_preset(preset), list(overrides or []))
    return from_dict(RunConfig, tree).validate()
