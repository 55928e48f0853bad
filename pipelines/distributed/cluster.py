"""The cluster the job runs on, and what its shape means for paths and GPU requests.

A real cluster is not one machine: the head (often ``CPU: 0``) runs the driver, and Ray
Train workers, Ray Data tasks and the actors run on worker nodes with their own disks. So:

- **Paths.** On more than one node, a local output, data, OOD or weights path names a
  different folder on every node: it is refused in one line (:func:`check_paths`) unless
  ``storage.shared_fs: true`` says every node mounts it at the same place (NFS, EFS,
  Lustre, ...). Object-store URIs (``s3://``) are the same everywhere.
- **Relative outputs** resolve against the directory the job was started from, except inside
  the unpacked copy of ``ray job submit --working-dir`` (a new folder per upload, so a
  re-submitted job could never resume there): then against ``$INFOFORM_HOME`` or
  ``~/infoform`` (:func:`resolve_output`).
- **GPU shares.** A search/evaluation actor asks for whole GPUs or for a fraction ``1/k``
  that tiles a GPU exactly (:func:`gpu_share`), decided from the config and the GPUs the
  cluster declares (``ray.cluster_resources()``, not what happens to be free), so that
  every actor can be placed at once; an explicit ``evaluate.gpus_per_actor`` that does not
  tile (0.75, 1.5) is refused (:func:`check_gpu_request`).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipelines.config.choices import RESOURCE_UNITS, check_gpu_request
from pipelines.storage import uris as storage
from pipelines.errors import PreflightError

__all__ = [
    "ClusterShape",
    "cluster_shape",
    "check_paths",
    "gpu_share",
    "check_gpu_request",
    "resolve_output",
    "in_ray_working_dir",
    "HOME_ENV",
]

#: Environment variable naming the base of relative outputs inside a Ray working-dir copy.
HOME_ENV = "INFOFORM_HOME"
_WORKING_DIR_MARK = os.sep + os.path.join("runtime_resources", "working_dir_files") + os.sep


@dataclass(frozen=True)
class ClusterShape:
    """Alive nodes and the resources they declare (totals, not what is free now)."""

    nodes: int
    cpus: float
    gpus: float
    driver_node_cpus: float

    @property
    def multi_node(self) -> bool:
        return self.nodes > 1

    def to_dict(self) -> dict[str, Any]:
        return {"nodes": self.nodes, "cpus": self.cpus, "gpus": self.gpus, "driver_node_cpus": self.driver_node_cpus}


def cluster_shape() -> ClusterShape:
    """The shape of the cluster this process is connected to (Ray must be initialised)."""
    import ray

    alive = [n for n in ray.nodes() if n.get("Alive")]
    here = ray.get_runtime_context().get_node_id()
    driver = next((n for n in alive if n.get("NodeID") == here), {})
    total = ray.cluster_resources()
    return ClusterShape(nodes=len(alive), cpus=float(total.get("CPU", 0.0)), gpus=float(total.get("GPU", 0.0)),
                        driver_node_cpus=float(driver.get("Resources", {}).get("CPU", 0.0)))


def _local_paths(cfg) -> list[tuple[str, str]]:
    """``(what, path)`` for every local (not object-store) path the workers would read or write."""
    out = [("--output", cfg.output)]
    if not cfg.data.demo and cfg.data.root:
        out.append(("--data", cfg.data.root))
    out += [("--ood", o.uri) for o in cfg.data.ood]
    for spec in cfg.all_models():
        if spec.weights and ("/" in spec.weights or spec.weights.endswith((".pt", ".pth", ".safetensors"))):
            out.append(("--weights", spec.weights))
    return [(what, p) for what, p in out if not storage.is_remote(p)]


def check_paths(cfg, shape: ClusterShape) -> None:
    """On a cluster of several nodes, refuse local paths unless ``storage.shared_fs`` is set.
    Raises :class:`pipelines.errors.PreflightError` (one line)."""
    if not shape.multi_node or cfg.storage.shared_fs:
        return
    local = _local_paths(cfg)
    if local:
        what, path = local[0]
        raise PreflightError(
            f"{what} {path} is a local path, but the cluster has {shape.nodes} nodes: each would see its own "
            "disk there. Use an object store (s3://bucket/prefix), or a folder every node mounts at the same "
            "place and --set storage.shared_fs=true")


def gpu_share(num_actors: int, cluster_gpus: float) -> float:
    """GPUs per actor so that ``num_actors`` actors fit on ``cluster_gpus`` GPUs at once:
    1 when there are enough GPUs, else ``1/k`` with ``k = ceil(num_actors / GPUs)`` actors
    sharing each GPU (``k`` shares of ``1/k`` tile a GPU exactly). 0 without GPUs."""
    if num_actors < 1:
        raise ValueError(f"num_actors must be >= 1, got {num_actors}")
    gpus = int(math.floor(cluster_gpus + 1e-9))
    if gpus < 1:
        return 0.0
    if num_actors <= gpus:
        return 1.0
    k = math.ceil(num_actors / gpus)
    # 1/k rounded down to Ray's resource unit (1e-4): k shares then fit one GPU however Ray
    # rounds (1/6 as a float would become 1667 units, and six of those do not fit)
    return math.floor(RESOURCE_UNITS / k) / RESOURCE_UNITS


def in_ray_working_dir(cwd: str | None = None) -> bool:
    """True inside the unpacked copy of a ``ray job submit --working-dir`` upload."""
    return _WORKING_DIR_MARK in os.path.join(cwd or os.getcwd(), "")


def resolve_output(output: str, cwd: str | None = None) -> str:
    """An absolute output: object-store URIs and absolute paths as given; a relative path
    against ``cwd``, or, inside a Ray working-dir copy, against ``$INFOFORM_HOME`` (default
    ``~/infoform``), which outlives the upload and so lets a re-submitted job resume."""
    if storage.is_remote(output):
        return output
    path = storage.get_fs(output)[1] if output.startswith("file://") else os.path.expanduser(output)
    if os.path.isabs(path):
        return os.path.normpath(path)
    cwd = cwd or os.getcwd()
    base = cwd
    if in_ray_working_dir(cwd):
        base = os.environ.get(HOME_ENV) or str(Path.home() / "infoform")
    return os.path.normpath(os.path.join(base, path))


# --------------------------------------------------------------------------- a quiet log
#: ``--verbose`` sets this: Ray's own INFO lines (Ray Train's controller, Ray Data's
#: per-dataset lines, the local instance's start) come back.
VERBOSE_ENV = "INFOFORM_VERBOSE"


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV, "") not in ("", "0")


def quiet_env(address: str | None = None) -> dict[str, str]:
    """Environment for the processes of a local Ray instance the job starts: Ray Data at
    ERROR unless ``--verbose``, and Ray's internal clients (e.g. Ray Train's placement-group
    cleaner, which looks the cluster up by itself) pointed at this instance, so that another
    Ray instance on the machine does not make them fail with "Found multiple active Ray
    instances"."""
    env = {} if verbose() else {"RAY_DATA_LOG_LEVEL": "ERROR", "RAY_AIR_NEW_OUTPUT": "0"}  # Tune: no boxes
    if address:
        env["RAY_ADDRESS"] = address
    return env


def train_log_level() -> str:
    """Ray Train's own log level: its controller's INFO and WARNING lines only with ``--verbose``
    (on a loaded machine its controller warns, with a traceback, that a resource request to Ray
    Data's autoscaling coordinator timed out, "safe to ignore": a wall of lines the job's own
    progress and errors do not need)."""
    return "INFO" if verbose() else "ERROR"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_local_instance(level: int) -> str:
    """Start the job's private local Ray instance, bound to loopback only, on a port chosen here so
    that its processes can be told its address (another Ray instance on the machine must not make
    Ray's own clients inside the job ask which one to use); its address, also left in
    ``RAY_ADDRESS`` for this process's own clients (state API, Ray Data, Train).

    The instance's processes inherit this process's environment (the raylet, so every worker):
    :func:`quiet_env` and the address go there, not into a runtime env, which would start each
    worker through Ray's ``setup_worker.py`` (a second Python importing Ray before the worker)."""
    import ray

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    here = f"127.0.0.1:{(port := _free_port())}"
    os.environ.update({k: os.environ.get(k, v) for k, v in quiet_env().items()}, RAY_ADDRESS=here,
                      RAY_GCS_SERVER_PORT=str(port))
    try:  # the dashboard serves the state API that Ray Train's placement-group cleaner polls
        ray.init(address="local", include_dashboard=True, dashboard_host="127.0.0.1", dashboard_port=_free_port(),
                 _node_ip_address="127.0.0.1", logging_level=level)
    except BaseException:
        del os.environ["RAY_ADDRESS"]
        raise
    finally:
        del os.environ["RAY_GCS_SERVER_PORT"]
    return here
