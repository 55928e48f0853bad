"""The data plan of a run: where the images are, each split's decode settings, and the
held-out splits (search / test / OOD), all scanned on the driver before any cluster work.

The embedded demo writes its digits and letters once (to the output as Parquet when the
output is remote, so that every node reads them from there) and trains its small CNN.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from pipelines.console import log
from pipelines.config.load import derive
from pipelines.config.schema import ModelSpec, OODSetSpec, RunConfig
from pipelines.storage import layout
from pipelines.storage import uris as storage

DEMO_NUM_CLASSES = 10
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def _folder_name(uri: str) -> str:
    name = uri.rstrip("/").replace("\\", "/").rsplit("/", 1)[-1]
    return name.split("://", 1)[-1] or "data"


def _given_int(overrides: Sequence[str], key: str) -> int | None:
    """The integer a ``--set key=value`` gives (the last one), None when none or not an integer."""
    got = [o.partition("=")[2].strip() for o in overrides if o.partition("=")[0].strip() == key]
    return int(got[-1]) if got and got[-1].isdigit() else None


def custom_preset(model: str | None, weights: str | None, data: str | None,
                  overrides: Sequence[str] = ()) -> tuple[list[str], str]:
    """What the ``custom`` preset (no ``--preset``, your own model and data) derives from the
    model: ``key=value`` settings (image size and normalisation of the torchvision weights' own
    eval transforms where known, else 224 and ImageNet's statistics; output
    ``runs/<model>-<data folder name>``) and the line that says so. Flags and ``--set`` given
    by the user (``overrides``) come after these and win; a ``data.image_size`` given without a
    ``data.resize_size`` takes the resize at the same crop ratio (28 px: resize 32, not a 28 px
    crop out of 256)."""
    from pipelines.ingest.models import RANDOM_WEIGHTS
    from pipelines.ingest.transforms import default_transforms

    name = model or "resnet50"
    t = default_transforms(name, weights)
    if t is None:
        t = {"image_size": 224, "resize_size": 256, "mean": IMAGENET_MEAN, "std": IMAGENET_STD}
        how = (f"{name} has no torchvision weights to take the transforms from: images at 224 px (resize 256) and "
               "ImageNet's mean/std; set data.image_size, data.mean, data.std if your model was trained otherwise")
    elif t.get("note"):  # a timm model's own data config
        how = f"images as in {t['note']}"
    else:
        how = (f"images at {t['image_size']} px (resize {t['resize_size']}) and the normalisation of "
               f"{t['source']}'s transforms")
    size = _given_int(overrides, "data.image_size")
    if size is not None and _given_int(overrides, "data.resize_size") is None:
        t = dict(t, resize_size=max(size, round(size * t["resize_size"] / t["image_size"])))
        how += f"; data.image_size={size} given, so resize {t['resize_size']} (the same crop ratio)"
    norm = [k for k in ("data.mean", "data.std") if any(o.partition("=")[0].strip() == k for o in overrides)]
    if norm:
        how += f"; {' and '.join(norm)} as given"
    short = name.rsplit(":", 1)[-1].rsplit(".", 1)[-1]
    sets = [f"data.image_size={t['image_size']}", f"data.resize_size={t['resize_size']}",
            f"data.mean=[{', '.join(map(str, t['mean']))}]", f"data.std=[{', '.join(map(str, t['std']))}]"]
    if data:
        sets.append(f"output={json.dumps(f'runs/{short}-{_folder_name(data)}')}")
    given = ", ".join(f for f, v in (("--data", data), ("--model", model), ("--weights", weights)) if v)
    why = f"preset custom (no --preset; {given} given): your model {name}" + (f" on {data}" if data else "") + f"; {how}"
    if weights == RANDOM_WEIGHTS:
        why += "; --weights random: a test run with randomly initialised weights, not a trained model"
    sets.append(f"description={json.dumps(why)}")
    return sets, why


@dataclass(frozen=True)
class DataPlan:
    """Where a run's images are: the data root and OOD sets (the demo's letters, published to a
    remote output when there is one, before the config's sets; or the config's), the demo's own
    input statistics."""

    root: str
    ood: Any  # the OOD sets: OODSetSpec-like (name, uri, group, limit), or None / () for none
    mean: tuple[float, float, float] | None
    std: tuple[float, float, float] | None
    demo: dict[str, Any] | None
    train_root: str | None = None  # the demo's local ImageFolder, where the demo CNN is trained


#: The machine's cache of the embedded demo (``$INFOFORM_CACHE``, default ``~/.cache/infoform``):
#: the demo's local files for a remote output, and its trained CNN for every output (trained once
#: per machine and settings, then copied into the run's own folder).
CACHE_ENV = "INFOFORM_CACHE"


def machine_cache() -> Path:
    return Path(os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "infoform"))


def _demo_dir(output: str) -> str:
    if storage.is_remote(output):
        return str(machine_cache() / "demo")
    return storage.get_fs(output)[1]


def _publish_demo(cfg: RunConfig, local: str, remote: str, split: str | None) -> None:
    """Copy one split of the demo's local ImageFolder to ``remote`` as Parquet shards (the
    encoded JPEG bytes unchanged), unless the same data is there already: with a remote
    output the demo's images are read from the output, so that any node can read them."""
    from pipelines.ingest.index import DataConfig
    from pipelines.ingest.parquet import PARQUET_META_FILE, convert_to_parquet
    from pipelines.ingest.scan import scan

    ep = cfg.storage_options()
    index = scan(DataConfig(root=local, split=split, unlabeled=split is None,
                            extensions=(".jpg",) if split is None else None))
    meta_uri = storage.join(remote, PARQUET_META_FILE)
    if storage.exists(meta_uri, ep) and storage.read_json(meta_uri, ep).get("source_fingerprint") == index.fingerprint:
        return
    convert_to_parquet(index, remote, options=None, out_options=ep)


def prepare_demo(cfg: RunConfig, output: str) -> DataPlan:
    from pipelines.ingest.demo_data import NORMALIZE_MEAN, NORMALIZE_STD, write_digits_imagefolder, write_letters_ood

    base = Path(_demo_dir(output))
    digits = write_digits_imagefolder(base / "demo-data" / "digits", size=32, seed=0)
    write_letters_ood(base / "demo-data" / "letters", size=32, n_per_letter=30, seed=0)
    root, ood = str(base / "demo-data" / "digits"), str(base / "demo-data" / "letters")
    if storage.is_remote(output):  # every node reads the demo from the output, not from this machine's disk
        remote = layout.demo_data_uri(output)
        for split in (cfg.data.train_split, cfg.data.val_split, cfg.data.test_split):
            if split:
                _publish_demo(cfg, root, storage.join(remote, "digits", split), split)
        _publish_demo(cfg, ood, storage.join(remote, "letters"), None)
        root, ood = storage.join(remote, "digits"), storage.join(remote, "letters")
        log(f"demo data written to {remote} (Parquet), read from there by every node")
    own = tuple(o for o in cfg.data.ood if o.name != "letters")  # a configured 'letters' set replaces the demo's
    return DataPlan(
        root=root,
        ood=(OODSetSpec(uri=ood, name="letters"), *own),
        mean=NORMALIZE_MEAN,
        std=NORMALIZE_STD,
        demo={"digits": root, "letters": ood, "classes": digits["classes"]},
        train_root=digits["root"],
    )


def _copy_files(src: Path, dst: Path, names: tuple[str, ...]) -> None:
    """``names`` from ``src`` into ``dst``, each replaced atomically when its bytes differ."""
    dst.mkdir(parents=True, exist_ok=True)
    for name in names:
        data = (src / name).read_bytes()
        if not (dst / name).exists() or (dst / name).read_bytes() != data:
            tmp = dst / f".{name}.{os.getpid()}.tmp"
            tmp.write_bytes(data)
            os.replace(tmp, dst / name)


def demo_model(cfg: RunConfig, plan: DataPlan, output: str) -> tuple[ModelSpec, dict[str, Any]]:
    from pipelines.ingest.demo_data import DEMO_EPOCHS, train_small_cnn

    cache = Path(_demo_dir(output)) / "model"
    shared = machine_cache() / "demo" / "model"
    try:
        shared.mkdir(parents=True, exist_ok=True)
    except OSError:  # an unwritable machine cache: train into the run's folder
        shared = cache
    # trained once per machine and settings (deterministic: seeded, one thread), copied into the run
    _, info = train_small_cnn(plan.train_root, epochs=DEMO_EPOCHS, seed=0, cache_path=shared, num_threads=1)
    if shared != cache:
        _copy_files(shared, cache, ("small_cnn.safetensors", "small_cnn.json"))
        info = dataclasses.replace(info, cache_path=str(cache))
    weights = str(cache / "small_cnn.safetensors")
    if storage.is_remote(output):  # the workers and actors load the weights from the output
        remote = layout.demo_model_uri(output, "small_cnn.safetensors")
        data = Path(weights).read_bytes()
        ep = cfg.storage_options()
        if not storage.exists(remote, ep) or storage.read_bytes(remote, ep) != data:
            storage.write_bytes_atomic(remote, data, ep)
        weights = remote
    info_d = dataclasses.asdict(info) if dataclasses.is_dataclass(info) else dict(info)
    return ModelSpec(name="demo_cnn", weights=weights, num_classes=DEMO_NUM_CLASSES), info_d


def data_config(cfg: RunConfig, plan: DataPlan, split: str | None, *, limit=None, per_class=None,
                 classes=None, unlabeled=False, root: str | None = None, extensions=None):
    """One split's :class:`~pipelines.ingest.index.DataConfig`, derived from ``cfg.data``; the
    input normalisation is ``data.mean`` / ``data.std`` when set, else the plan's (the demo's
    own statistics), else ImageNet's. Files are indexed by ``extensions`` when given, else by
    the image suffixes widened by ``data.extensions``."""
    from pipelines.ingest.index import IMAGE_EXTENSIONS, DataConfig

    norm = {k: v for k, v in (("mean", plan.mean), ("std", plan.std)) if v is not None and getattr(cfg.data, k) is None}
    kw: dict[str, Any] = dict(root=root or plan.root, split=split, limit=limit, per_class=per_class,
                              storage_options=cfg.storage_options(), unlabeled=unlabeled, partition_size=None, **norm)
    if classes is not None:
        kw["classes"] = tuple(classes)
    extra = tuple(e if e.startswith(".") else "." + e for e in cfg.data.extensions)
    kw["extensions"] = tuple(extensions) if extensions is not None else IMAGE_EXTENSIONS + extra
    if split == cfg.data.val_split and cfg.data.labels_csv:
        kw["labels_csv"] = cfg.data.labels_csv
    else:
        kw["labels_csv"] = None
    return derive(DataConfig, cfg.data, **kw)


def subset(index, keep: int, parts: int = 2, limit: int | None = None):
    """Deterministic interleaved subset of a DatasetIndex: within each class, entries at
    positions ``keep, keep+parts, ...`` (disjoint for different ``keep``), then at most
    ``limit`` entries spread evenly."""
    from pipelines.ingest.index import fingerprint as data_fingerprint

    seen: dict[int, int] = {}
    keep_idx = []
    for i, y in enumerate(index.labels):
        k = seen.get(y, 0)
        seen[y] = k + 1
        if k % parts == keep:
            keep_idx.append(i)
    if limit is not None and len(keep_idx) > limit:
        step = len(keep_idx) / limit
        keep_idx = [keep_idx[int(j * step)] for j in range(limit)]
    return take(index, keep_idx, data_fingerprint)


def take(index, idx, fp_fn):
    paths = tuple(index.paths[i] for i in idx)
    labels = tuple(index.labels[i] for i in idx)
    counts = [0] * len(index.classes)
    for y in labels:
        if y >= 0:
            counts[y] += 1
    kw = dict(paths=paths, labels=labels, class_counts=tuple(counts),
              fingerprint=fp_fn(index.classes, paths, labels))
    if index.locations:
        kw["locations"] = tuple(index.locations[i] for i in idx)
    return dataclasses.replace(index, **kw)


def limit_index(index, limit: int | None):
    from pipelines.ingest.index import fingerprint as data_fingerprint

    if limit is None or len(index) <= limit:
        return index
    step = len(index) / limit
    return take(index, [int(j * step) for j in range(limit)], data_fingerprint)


@dataclass(frozen=True)
class Splits:
    """The scanned splits of one run: training partitions, the search split, the test split
    and the OOD set (their indices and decode settings)."""

    train: Any
    train_config: Any
    parts: list
    classes: tuple
    search: Any
    search_config: Any
    test: Any
    test_config: Any
    oods: tuple = ()  # OODSplit per OOD set, in the config's order
    scanned: dict = dataclasses.field(default_factory=dict)  # split name -> its full scan (ignored files)

    @property
    def ood(self) -> Any:
        """The first OOD set's index (``run:ood``), or None."""
        return self.oods[0].index if self.oods else None

    @property
    def ood_config(self) -> Any:
        return self.oods[0].config if self.oods else None

    def ignored(self) -> dict[str, dict[str, Any]]:
        """Per scanned split, the files not indexed as images: ``{"count", "examples"}`` (first three)."""
        return {k: {"count": ix.ignored, "examples": list(ix.ignored_examples)} for k, ix in self.scanned.items()}

    def summary(self, cfg: RunConfig, plan: DataPlan) -> dict[str, Any]:
        return {
            "train": self.train.summary(),
            "ignored_files": self.ignored(),
            "search": {"split": cfg.data.val_split, "num_files": len(self.search)},
            "test": {"split": cfg.data.test_split or f"{cfg.data.val_split} (other half)", "num_files": len(self.test)},
            "ood": None if self.ood is None else self.ood.summary(),
            "ood_sets": {o.name: {"group": o.group, **o.index.summary()} for o in self.oods},
            "num_classes": len(self.classes),
            "partitions": len(self.parts),
            "demo": plan.demo,
        }


def scan_splits(cfg: RunConfig, plan: DataPlan) -> Splits:
    """Scan every split on the driver. With no ``data.test_split``, the one labelled held-out
    split gives disjoint halves to the search and the evaluation."""
    from pipelines.ingest.index import partition
    from pipelines.ingest.index_store import IndexedListing
    from pipelines.ingest.scan import scan as scan_split
    from pipelines.ingest.table_scan import release_unused

    listing = IndexedListing(cfg.output, cfg.storage_options(), relist=cfg.data.relist, log=log)

    def scan(dc, name=None):  # each split's listing persisted under <output>/index/ and reused
        return scan_split(dc, listing.lister(name or dc.split or "data"))

    train_cfg = data_config(cfg, plan, cfg.data.train_split, limit=cfg.data.limit, per_class=cfg.data.per_class)
    train = scan(train_cfg)
    classes = train.classes
    val_cfg = data_config(cfg, plan, cfg.data.val_split, classes=classes)
    val_full = scan(val_cfg)
    scanned = {"train": train, "val": val_full}
    if cfg.data.test_split:
        test_cfg = data_config(cfg, plan, cfg.data.test_split, classes=classes)
        search = limit_index(val_full, cfg.data.val_limit)
        scanned["test"] = scan(test_cfg)
        test = limit_index(scanned["test"], cfg.data.test_limit)
    else:
        test_cfg = val_cfg
        search = subset(val_full, 0, limit=cfg.data.val_limit)
        test = subset(val_full, 1, limit=cfg.data.test_limit)
    oods = tuple(_scan_ood(cfg, plan, o, k, scan, scanned) for k, o in enumerate(plan.ood or ()))
    parts = partition(train, partition_size=cfg.data.partition_size)
    release_unused()  # the scans' and fingerprints' temporaries: not kept through the stages
    return Splits(train=train, train_config=train_cfg, parts=parts, classes=classes, search=search,
                  search_config=val_cfg, test=test, test_config=test_cfg, oods=oods,
                  scanned=scanned)


@dataclass(frozen=True)
class OODSplit:
    """One scanned OOD set: its name, group, index (at most its limit) and decode settings."""

    name: str
    group: str | None
    index: Any
    config: Any


def _scan_ood(cfg: RunConfig, plan: DataPlan, o: Any, k: int, scan: Any, scanned: dict) -> OODSplit:
    """Scan OOD set ``o`` (the ``k``-th): the first keeps today's listing name ``ood``."""
    demo_letters = plan.demo is not None and o.uri == plan.demo.get("letters")
    dc = data_config(cfg, plan, None, root=o.uri, unlabeled=True, extensions=(".jpg",) if demo_letters else None)
    key = "ood" if k == 0 else f"ood-{o.name}"
    full = scan(dc, key)
    if not demo_letters:  # the demo's letters folder also holds its own infoform-letters.json
        scanned[key] = full
    limit = o.limit if o.limit is not None else cfg.data.ood_limit
    return OODSplit(o.name, o.group, limit_index(full, limit), dc)


def config_plan(cfg: RunConfig, output: str) -> DataPlan:
    """The demo's plan (:func:`prepare_demo`) or the config's data and OOD roots."""
    if cfg.data.demo:
        return prepare_demo(cfg, output)
    return DataPlan(root=cfg.data.root, ood=cfg.data.ood, mean=None, std=None, demo=None)


def data_config_for(cfg: RunConfig, root: str, split: str | None, **kw: Any):
    """The :class:`~pipelines.ingest.index.DataConfig` a run of ``cfg`` uses for ``split`` of
    the (non-demo) images under ``root``."""
    return data_config(cfg, DataPlan(root=root, ood=None, mean=None, std=None, demo=None), split, **kw)
