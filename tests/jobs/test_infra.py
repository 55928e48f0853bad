"""The deployment files in infra/ agree with the code, the presets and pyproject.toml.

Fast and offline: no cluster, no network, Ray is imported only for its runtime-env validator and
its launcher schema file. What is checked, and why it would break a real run:

- every manifest parses (all documents of multi-document files, and the YAML embedded in
  ``runtimeEnvYAML`` strings and in the fallback CronJob's ConfigMap);
- every job entrypoint (RayJob, RayCronJob, the ConfigMap's RayJob, the commands in
  infra/README.md) names a script that exists and whose arguments parse with the job's own
  parser, ``jobs.imagenet_inf.get_args_parser()`` + ``config_from_args()`` (a dry run: nothing is
  read, so ``s3://YOUR-BUCKET`` placeholders are fine); cluster runs write to s3:// and are not the
  demo; the GPU worker groups can hold the preset's Train workers and evaluation actors;
- the Ray version in image tags, ``rayVersion`` fields and launcher commands, and every pip pin
  in the runtime envs, agree with pyproject.toml (parsed with tomllib);
- the launcher config validates against Ray's own ray-schema.json; runtime envs pass Ray's
  validator and use only known fields; RayJob/RayCronJob specs use only CRD fields;
- the cron schedules are valid 5-field expressions, and the weekly run's deadline is shorter
  than its period (the RayCronJob CRD has no concurrencyPolicy);
- nothing in infra/ looks like an AWS credential.
"""
from __future__ import annotations

import copy
import json
import re
import shlex
import tomllib
from functools import lru_cache
from importlib.util import find_spec
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
INFRA = REPO / "infra"
PYPROJECT = REPO / "pyproject.toml"

LAUNCHER = INFRA / "cluster-aws.yaml"
RUNTIME_ENV = INFRA / "runtime_env.yaml"
RAYJOB = INFRA / "rayjob.yaml"
RAYCRONJOB = INFRA / "raycronjob-audit.yaml"
CRONJOB = INFRA / "cronjob-submit.yaml"
README = INFRA / "README.md"
KUBE_FILES = (RAYJOB, RAYCRONJOB, CRONJOB)
MANIFESTS = (LAUNCHER, RUNTIME_ENV, *KUBE_FILES)

# RayJobSpec / RayCronJobSpec fields of the KubeRay CRDs (ray-operator/apis/ray/v1, KubeRay 1.6).
RAYJOB_SPEC_FIELDS = {
    "activeDeadlineSeconds", "backoffLimit", "rayClusterSpec", "submitterPodTemplate", "metadata",
    "clusterSelector", "submitterConfig", "managedBy", "deletionStrategy", "entrypoint",
    "runtimeEnvYAML", "jobId", "submissionMode", "entrypointResources", "entrypointNumCpus",
    "entrypointNumGpus", "ttlSecondsAfterFinished", "shutdownAfterJobFinishes", "suspend",
}
RAYCRONJOB_SPEC_FIELDS = {"schedule", "jobTemplate", "suspend"}  # KubeRay 1.7 adds timeZone
CREDENTIAL_ENV_NAMES = {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                        "AWS_EC2_METADATA_DISABLED"}  # the last one switches instance roles off


# --------------------------------------------------------------------------- helpers
@lru_cache(maxsize=None)
def _parsed(path: Path, mtime_ns: int) -> tuple:
    return tuple(d for d in yaml.safe_load_all(path.read_text()) if d is not None)


def load_all(path: Path) -> list[Any]:
    """All documents of a YAML file (parsed once per file version; callers get a private copy)."""
    docs = copy.deepcopy(list(_parsed(path, path.stat().st_mtime_ns)))
    assert docs, f"{path.name}: no YAML documents"
    return docs


def walk(node: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted path, value) for every node of a parsed YAML tree."""
    yield path, node
    if isinstance(node, dict):
        for k, v in node.items():
            yield from walk(v, f"{path}.{k}" if path else str(k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from walk(v, f"{path}[{i}]")


def pyproject() -> dict:
    return tomllib.loads(PYPROJECT.read_text())


def pyproject_requirements() -> dict[str, str]:
    """Normalised requirement name -> requirement string (specifier and extras kept verbatim)."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    return {canonicalize_name(Requirement(r).name): r for r in pyproject()["project"]["dependencies"]}


def pinned_ray_version() -> str:
    ray_req = pyproject_requirements().get("ray")
    assert ray_req, "pyproject.toml has no ray dependency"
    m = re.fullmatch(r"ray(\[[^\]]*\])?==([0-9][0-9.]*)", ray_req.replace(" ", ""))
    assert m, f"pyproject.toml must pin ray exactly (ray[...]==X.Y.Z), got {ray_req!r}"
    return m.group(2)


def python_tag() -> str:
    """'py311' from requires-python '>=3.11,<3.12'."""
    spec = pyproject()["project"]["requires-python"]
    m = re.search(r">=\s*3\.(\d+)", spec)
    assert m, f"cannot read the Python version from requires-python {spec!r}"
    return f"py3{m.group(1)}"


def kube_docs() -> list[tuple[Path, dict]]:
    return [(p, d) for p in KUBE_FILES for d in load_all(p)]


def embedded_rayjobs() -> list[tuple[str, dict]]:
    """RayJob manifests kept as strings in ConfigMaps (the plain-CronJob fallback)."""
    out = []
    for path, doc in kube_docs():
        if doc.get("kind") == "ConfigMap":
            for key, text in (doc.get("data") or {}).items():
                if key.endswith((".yaml", ".yml")):
                    for sub in yaml.safe_load_all(text):
                        if sub and sub.get("kind") == "RayJob":
                            out.append((f"{path.name}:ConfigMap/{doc['metadata']['name']}/{key}", sub))
    return out


def rayjob_specs() -> list[tuple[str, dict]]:
    """Every RayJob spec: RayJob documents, RayCronJob jobTemplates, ConfigMap-embedded RayJobs."""
    out = []
    for path, doc in kube_docs():
        if doc.get("kind") == "RayJob":
            out.append((f"{path.name}:RayJob/{doc['metadata']['name']}", doc["spec"]))
        elif doc.get("kind") == "RayCronJob":
            out.append((f"{path.name}:RayCronJob/{doc['metadata']['name']}", doc["spec"]["jobTemplate"]))
    out += [(where, d["spec"]) for where, d in embedded_rayjobs()]
    return out


def runtime_envs() -> list[tuple[str, dict]]:
    envs = [(RUNTIME_ENV.name, load_all(RUNTIME_ENV)[0])]
    for where, spec in rayjob_specs():
        text = spec.get("runtimeEnvYAML")
        assert text, f"{where}: no runtimeEnvYAML (the job would run without the pinned packages)"
        assert "$" not in text, (f"{where}: runtimeEnvYAML contains '$'; KubeRay passes it through a shell "
                                 "inside double quotes, where it would be expanded")
        envs.append((f"{where}.runtimeEnvYAML", yaml.safe_load(text)))
    return envs


_SUBST = re.compile(r"\$\(([^()]*)\)")


def job_argv(command: str, where: str) -> tuple[str, list[str]]:
    """Script path and arguments of ``[ray job submit ... --] python SCRIPT ARGS``.

    ``$(date ...)`` command substitutions (expanded by the shell at submission) are replaced by a
    sample value; any other substitution is refused.
    """
    for inner in _SUBST.findall(command):
        assert inner.split()[0] == "date", f"{where}: only $(date ...) substitutions are expected, got $({inner})"
    command = _SUBST.sub("2026-W47", command)
    tokens = shlex.split(command)
    if "--" in tokens:
        tokens = tokens[tokens.index("--") + 1:]
    assert len(tokens) >= 2 and tokens[0] in ("python", "python3"), f"{where}: entrypoint is not `python SCRIPT ...`: {command!r}"
    return tokens[1], tokens[2:]


def dry_run(command: str, where: str):
    """Parse an entrypoint with the job's own parser; returns the validated RunConfig."""
    from jobs.imagenet_inf import config_from_args, get_args_parser

    script, args = job_argv(command, where)
    assert (REPO / script).is_file(), f"{where}: entrypoint script {script} does not exist in the repository"
    assert script == "jobs/imagenet_inf.py", f"{where}: unexpected entrypoint script {script}"
    parser = get_args_parser()
    try:
        ns = parser.parse_args(args)
    except SystemExit as e:  # argparse reports through exit
        pytest.fail(f"{where}: entrypoint arguments do not parse ({e}): {args}")
    return config_from_args(ns)


def readme_commands() -> list[str]:
    """Shell commands in README code blocks that run the job (backslash continuations joined)."""
    text = README.read_text()
    cmds = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = line.split(" #", 1)[0].strip()
            if "jobs/imagenet_inf.py" in line and not line.startswith("#"):
                cmds.append(line)
    return cmds


def worker_groups(spec: dict) -> list[dict]:
    return spec["rayClusterSpec"]["workerGroupSpecs"]


def container_gpus(container: dict) -> int:
    return int((container.get("resources", {}).get("limits") or {}).get("nvidia.com/gpu", 0))


def cpu_quantity(value: str | int | float) -> float:
    s = str(value)
    return float(s[:-1]) / 1000 if s.endswith("m") else float(s)


# --------------------------------------------------------------------------- parsing
@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifests_parse(path):
    for doc in load_all(path):
        assert isinstance(doc, dict), f"{path.name}: a document is not a mapping"


def test_kubernetes_documents_have_kind_and_api_version():
    for path, doc in kube_docs():
        assert {"apiVersion", "kind", "metadata"} <= doc.keys(), f"{path.name}: {doc.get('kind')} lacks apiVersion/kind/metadata"
    kinds = {(d["apiVersion"], d["kind"]) for _, d in kube_docs()}
    assert ("ray.io/v1", "RayJob") in kinds and ("ray.io/v1", "RayCronJob") in kinds and ("batch/v1", "CronJob") in kinds


def test_launcher_config_matches_rays_schema():
    jsonschema = pytest.importorskip("jsonschema")
    spec = find_spec("ray")
    assert spec and spec.submodule_search_locations, "ray is not installed"
    schema_path = Path(list(spec.submodule_search_locations)[0]) / "autoscaler" / "ray-schema.json"
    schema = json.loads(schema_path.read_text())
    cfg = load_all(LAUNCHER)[0]
    jsonschema.validate(cfg, schema)
    assert cfg["provider"]["type"] == "aws"
    assert cfg["head_node_type"] in cfg["available_node_types"]
    head = cfg["available_node_types"][cfg["head_node_type"]]
    assert head["resources"].get("CPU", None) == 0, "the head must not take tasks (resources: {CPU: 0})"
    gpu_types = {k: v for k, v in cfg["available_node_types"].items() if v["resources"].get("GPU", 0) > 0}
    assert gpu_types, "no GPU worker node type"
    for name, nt in gpu_types.items():
        assert nt.get("min_workers", 0) <= nt["max_workers"] <= cfg["max_workers"], name


def test_launcher_installs_the_synced_project():
    cfg = load_all(LAUNCHER)[0]
    mounts = cfg["file_mounts"]
    assert "." in mounts.values(), "the launcher must sync the project directory ('.')"
    target = next(k for k, v in mounts.items() if v == ".")
    assert any(re.search(rf"pip install .*-e\s+{re.escape(target)}\b", c) for c in cfg["setup_commands"]), \
        f"setup_commands must `pip install -e {target}` (the synced project)"


# --------------------------------------------------------------------------- entrypoints
def test_rayjob_entrypoints_exist_and_parse():
    specs = rayjob_specs()
    assert len(specs) >= 3  # RayJob, RayCronJob template, ConfigMap RayJob
    for where, spec in specs:
        cfg = dry_run(spec["entrypoint"], where)
        assert cfg.output.startswith("s3://"), f"{where}: a cluster run must write to s3://, not {cfg.output!r}"
        assert not cfg.data.demo and (cfg.data.root or "").startswith("s3://"), f"{where}: data must come from s3://"


def test_entrypoint_presets():
    presets = {where.split(":")[1].split("/")[0]: dry_run(spec["entrypoint"], where).preset for where, spec in rayjob_specs()}
    assert presets["RayJob"] == "imagenet-resnet50"
    assert presets["RayCronJob"] == "audit"


def test_readme_commands_exist_and_parse():
    cmds = readme_commands()
    assert cmds, "infra/README.md shows no job command"
    for cmd in cmds:
        dry_run(cmd, f"README: {cmd[:60]}...")
        for ref in re.findall(r"infra/[\w.-]+\.ya?ml", cmd):
            assert (REPO / ref).is_file(), f"README command references missing {ref}"


def test_files_referenced_from_docs_and_manifests_exist():
    for path in (README, *MANIFESTS):
        for ref in set(re.findall(r"(?<![\w/.-])(?:infra|jobs|configs)/[\w.-]+\.(?:ya?ml|py)\b", path.read_text())):
            assert (REPO / ref).is_file(), f"{path.name} references {ref}, which does not exist"


def _gpus_needed(cfg) -> int:
    """GPUs a preset asks Ray for at once: the Train workers (``curvature.use_gpu``), or the
    search/evaluation actors with an explicit ``evaluate.gpus_per_actor`` (null takes what is there)."""
    import math

    train = cfg.curvature.num_workers if cfg.curvature.use_gpu else 0
    actors = math.ceil(cfg.evaluate.num_actors * (cfg.evaluate.gpus_per_actor or 0))
    return max(train, actors)


def test_gpu_worker_groups_fit_the_presets():
    """Ray Train waits forever for GPUs that the worker group can never provide."""
    for where, spec in rayjob_specs():
        cfg = dry_run(spec["entrypoint"], where)
        groups = worker_groups(spec)
        gpus = 0
        for g in groups:
            ctr = g["template"]["spec"]["containers"][0]
            per_pod = container_gpus(ctr)
            assert g["minReplicas"] <= g["replicas"] <= g["maxReplicas"], f"{where}: {g['groupName']} replicas out of bounds"
            if per_pod:
                cpus = cpu_quantity(ctr["resources"]["limits"]["cpu"])
                assert cpus > cfg.curvature.cpus_per_worker * per_pod, (
                    f"{where}: {g['groupName']} pods have {cpus} CPUs for {per_pod} Train worker(s) of "
                    f"{cfg.curvature.cpus_per_worker} CPUs; Ray Data needs CPUs left over")
            gpus += per_pod * g["maxReplicas"]
        need = _gpus_needed(cfg)
        assert gpus >= need, f"{where}: worker groups offer {gpus} GPUs, preset {cfg.preset} needs {need}"
        head = spec["rayClusterSpec"]["headGroupSpec"]
        assert str(head["rayStartParams"].get("num-cpus")) == "0", f"{where}: the head must not take tasks"
        assert container_gpus(head["template"]["spec"]["containers"][0]) == 0


def test_launcher_gpu_capacity_fits_the_presets():
    cfg = load_all(LAUNCHER)[0]
    from jobs.imagenet_inf import config_from_args, get_args_parser

    need = 0
    for preset in ("imagenet-resnet50", "audit"):
        rc = config_from_args(get_args_parser().parse_args(["--preset", preset, "--data", "s3://YOUR-BUCKET/x"]))
        need = max(need, _gpus_needed(rc))
        for name, nt in cfg["available_node_types"].items():
            gpu = nt["resources"].get("GPU", 0)
            if gpu:
                assert nt["resources"]["CPU"] > rc.curvature.cpus_per_worker * gpu, f"{name}: no CPU left for Ray Data"
    best = max(min(nt.get("max_workers", 0), cfg["max_workers"]) * nt["resources"].get("GPU", 0)
               for nt in cfg["available_node_types"].values())
    assert best >= need, f"the launcher can reach {best} GPUs of one type, the presets need {need}"


# --------------------------------------------------------------------------- versions and pins
def test_ray_version_and_image_tags_agree_with_pyproject():
    ver, py = pinned_ray_version(), python_tag()
    images, ray_versions = [], []
    trees = [(p.name, d) for p in MANIFESTS for d in load_all(p)] + embedded_rayjobs()
    for where, tree in trees:
        for path, value in walk(tree):
            if isinstance(value, str) and re.match(r"^(docker\.io/)?rayproject/ray", value):
                images.append((where, path, value))
            if path.endswith("rayVersion"):
                ray_versions.append((where, path, value))
    assert images and ray_versions
    for where, path, image in images:
        m = re.fullmatch(r"(?:docker\.io/)?rayproject/ray(?:-ml)?:([^@]+)(@sha256:[0-9a-f]{64})?", image)
        assert m, f"{where} {path}: unpinned or malformed Ray image {image!r}"
        assert m.group(1).startswith(f"{ver}-{py}"), f"{where} {path}: image {image} does not match ray=={ver} / {py}"
    for where, path, value in ray_versions:
        assert str(value) == ver, f"{where} {path}: rayVersion {value} != pyproject's ray=={ver}"
    for cmd in load_all(LAUNCHER)[0]["setup_commands"]:
        for found in re.findall(r"ray\.__version__\s*==\s*'([^']+)'", cmd):
            assert found == ver, f"cluster-aws.yaml setup check expects ray {found}, pyproject pins {ver}"


def test_runtime_env_pins_agree_with_pyproject():
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    expected = {k: v for k, v in pyproject_requirements().items() if k != "ray"}
    for where, env in runtime_envs():
        pip = env.get("pip")
        packages = pip["packages"] if isinstance(pip, dict) else pip
        assert packages, f"{where}: no pip packages"
        got = {canonicalize_name(Requirement(p).name): p for p in packages}
        assert "ray" not in got, f"{where}: do not install ray in a runtime env (the image fixes it)"
        for name in sorted(expected.keys() | got.keys()):
            want, have = expected.get(name), got.get(name)
            assert want is not None, f"{where}: pip has {have!r}, which pyproject.toml does not list"
            assert have is not None, f"{where}: pip lacks {want!r} from pyproject.toml"
            assert Requirement(have).specifier == Requirement(want).specifier, \
                f"{where}: pip pins {have!r}, pyproject.toml pins {want!r}"


def test_runtime_envs_pass_rays_validator():
    from ray.runtime_env import RuntimeEnv

    for where, env in runtime_envs():
        unknown = set(env) - set(RuntimeEnv.known_fields)
        assert not unknown, f"{where}: unknown runtime_env fields {sorted(unknown)}"
        RuntimeEnv(**env)  # raises on bad pip / working_dir / env_vars
        assert all(isinstance(v, str) for v in env.get("env_vars", {}).values()), f"{where}: env_vars must be strings"
    local = load_all(RUNTIME_ENV)[0]
    assert local["working_dir"] == "."
    for must in (".venv/", ".git/", "runs/"):
        assert must in local["excludes"], f"runtime_env.yaml must exclude {must}"
    for where, env in runtime_envs()[1:]:
        assert env["working_dir"].startswith("s3://") and env["working_dir"].endswith(".zip"), \
            f"{where}: a KubeRay job needs a remote working_dir zip, got {env['working_dir']!r}"


def test_kuberay_specs_use_crd_fields_only():
    for where, spec in rayjob_specs():
        unknown = set(spec) - RAYJOB_SPEC_FIELDS
        assert not unknown, f"{where}: fields {sorted(unknown)} are not in the RayJob CRD"
        assert spec["shutdownAfterJobFinishes"] is True and spec["ttlSecondsAfterFinished"] >= 0
        assert spec["activeDeadlineSeconds"] > 0 and spec["backoffLimit"] >= 0
    for path, doc in kube_docs():
        if doc["kind"] == "RayCronJob":
            unknown = set(doc["spec"]) - RAYCRONJOB_SPEC_FIELDS
            assert not unknown, (f"{path.name}: fields {sorted(unknown)} are not in KubeRay 1.6's RayCronJob CRD "
                                 "(no concurrencyPolicy there; kubectl's strict validation would reject them)")


def test_cronjob_fallback_creates_the_same_rayjob_as_the_raycronjob():
    template = next(d for _, d in kube_docs() if d["kind"] == "RayCronJob")["spec"]["jobTemplate"]
    embedded = embedded_rayjobs()
    assert len(embedded) == 1
    assert embedded[0][1]["spec"] == template, "cronjob-submit.yaml's RayJob drifted from raycronjob-audit.yaml"
    cron = next(d for _, d in kube_docs() if d["kind"] == "CronJob")
    assert cron["spec"]["concurrencyPolicy"] == "Forbid"
    pod = cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    sa = pod["serviceAccountName"]
    bindings = [d for _, d in kube_docs() if d["kind"] == "RoleBinding" and any(s["name"] == sa for s in d["subjects"])]
    assert bindings, f"no RoleBinding for the submitter's ServiceAccount {sa}"
    role = next(d for _, d in kube_docs() if d["kind"] == "Role" and d["metadata"]["name"] == bindings[0]["roleRef"]["name"])
    granted = {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}
    for verb in ("create", "list"):
        assert ("ray.io", "rayjobs", verb) in granted, f"the submitter Role cannot {verb} rayjobs"
    assert all(g == "ray.io" for g, _, _ in granted), "the submitter Role grants more than rayjobs"
    cm_names = {v["configMap"]["name"] for v in pod.get("volumes", []) if "configMap" in v}
    script = " ".join(pod["containers"][0]["args"])
    assert "kubectl create" in script and cm_names, "the CronJob must create the RayJob from the ConfigMap"


def test_service_accounts_are_defined_where_used():
    for path in KUBE_FILES:
        docs = load_all(path)
        defined = {d["metadata"]["name"] for d in docs if d["kind"] == "ServiceAccount"}
        trees = docs + [d for w, d in embedded_rayjobs() if w.startswith(path.name)]
        for tree in trees:
            for p, value in walk(tree):
                if p.endswith("serviceAccountName"):
                    assert value in defined, f"{path.name}: {p} = {value} but no ServiceAccount of that name in the file"


# --------------------------------------------------------------------------- schedules
_CRON_RANGES = [(0, 59), (0, 23), (1, 31), (1, 12), (0, 7)]
_CRON_NAMES = [None, None, None,
               {m: i + 1 for i, m in enumerate("jan feb mar apr may jun jul aug sep oct nov dec".split())},
               {d: i for i, d in enumerate("sun mon tue wed thu fri sat".split())}]


def cron_errors(expr: str) -> list[str]:
    """Problems with a standard 5-field cron expression ([] when valid)."""
    fields = expr.split()
    if len(fields) != 5:
        return [f"{expr!r} has {len(fields)} fields, expected 5 (minute hour day-of-month month day-of-week)"]
    errors = []
    for field, (lo, hi), names in zip(fields, _CRON_RANGES, _CRON_NAMES):
        for part in field.split(","):
            base, _, step = part.partition("/")
            if step and not (step.isdigit() and int(step) > 0):
                errors.append(f"bad step in {part!r}")
            if base == "*":
                continue
            for v in base.split("-", 1):
                v = v.lower()
                num = names.get(v) if names and v in names else (int(v) if v.isdigit() else None)
                if num is None or not lo <= num <= hi:
                    errors.append(f"{v!r} in {field!r} outside {lo}-{hi}")
    return errors


@pytest.mark.parametrize("expr,ok", [("0 3 * * 1", True), ("*/15 0-6 1,15 jan-mar mon-fri", True),
                                     ("0 3 * *", False), ("60 3 * * 1", False), ("0 24 * * 1", False),
                                     ("0 3 * * 8", False), ("0 3 */0 * *", False), ("@weekly", False)])
def test_cron_checker_itself(expr, ok):
    assert (cron_errors(expr) == []) is ok


def test_schedules_are_valid_and_weekly_runs_cannot_overlap():
    schedules = {}
    for path, doc in kube_docs():
        if doc["kind"] in ("RayCronJob", "CronJob"):
            expr = doc["spec"]["schedule"]
            assert not cron_errors(expr), f"{path.name}: {cron_errors(expr)}"
            schedules[doc["kind"]] = expr
    assert schedules.get("RayCronJob") == schedules.get("CronJob"), "the two schedulers should run the audit at the same time"
    minute, hour, dom, month, dow = schedules["RayCronJob"].split()
    template = next(d for _, d in kube_docs() if d["kind"] == "RayCronJob")["spec"]["jobTemplate"]
    if dom == month == "*" and dow.isdigit() and minute.isdigit() and hour.isdigit():  # once a week
        assert template["activeDeadlineSeconds"] < 7 * 24 * 3600, "a weekly run's deadline must end it before the next run"


# --------------------------------------------------------------------------- credentials
_SECRET_PATTERNS = [
    (re.compile(r"(?<![A-Z0-9])(?:AKIA|ASIA|AGPA|AIDA|AROA|ANPA|ANVA|AIPA)[A-Z0-9]{16}(?![A-Z0-9])"), "AWS access key id"),
    (re.compile(r"(?i)aws_secret_access_key\s*[:=]\s*['\"]?[A-Za-z0-9/+=]{20,}"), "AWS secret key assignment"),
    (re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----"), "private key"),
]
_B64_40 = re.compile(r"(?<![A-Za-z0-9/+=])[A-Za-z0-9/+=]{40}(?![A-Za-z0-9/+=])")


def secret_findings(text: str) -> list[str]:
    found = [f"{what}: {m.group(0)[:8]}..." for rx, what in _SECRET_PATTERNS for m in rx.finditer(text)]
    for m in _B64_40.finditer(text):  # 40-char secret access keys: mixed case and digits (hex digests are not)
        s = m.group(0)
        if re.search(r"[a-z]", s) and re.search(r"[A-Z]", s) and re.search(r"[0-9]", s):
            found.append(f"40-character key-like string: {s[:8]}...")
    return found


def test_secret_scanner_itself():
    fake_id = "AKIA" + "IOSFODNN7" + "EXAMPLE"  # AWS's documented example, assembled so no file holds it
    fake_secret = "wJalrXUtnFEMI/K7MDENG/" + "bPxRfiCYEXAMPLEKEY"
    assert secret_findings(f"key: {fake_id}")
    assert secret_findings(f"secret = {fake_secret}")
    assert secret_findings(f"aws_secret_access_key={fake_secret}")
    assert not secret_findings("image: rayproject/ray:2.60.0-py311-gpu@sha256:" + "ab12" * 16)


def test_no_credentials_in_infra():
    files = sorted(p for p in INFRA.rglob("*") if p.is_file())
    assert len(files) >= 6
    for p in files:
        findings = secret_findings(p.read_text(errors="replace"))
        assert not findings, f"{p.relative_to(REPO)} looks like it holds a credential: {findings}"
    trees = [(p.name, d) for p in MANIFESTS for d in load_all(p)] + embedded_rayjobs() + runtime_envs()
    for where, tree in trees:
        for path, value in walk(tree):
            if isinstance(value, dict):
                names = set(value) if path.endswith("env_vars") else {value.get("name")} if "value" in value or "valueFrom" in value else set()
                bad = names & CREDENTIAL_ENV_NAMES
                assert not bad, f"{where} {path}: sets {sorted(bad)}; credentials come from the AWS chain / roles"


# --------------------------------------------------------------------------- what a run costs
COST_SECTION = "## What a run costs"
#: the page holding the measured benchmark table (moved there from README.md)
BENCHMARKS_PAGE = REPO / "docs" / "benchmarks.md"


def cost_section() -> str:
    text = README.read_text()
    assert COST_SECTION in text, f"infra/README.md has no {COST_SECTION!r} section"
    return text.split(COST_SECTION, 1)[1]


def cost_inputs() -> dict[str, float]:
    """``name = value`` lines of the first ```text block of the cost section."""
    block = re.search(r"```text\n(.*?)```", cost_section(), flags=re.S)
    assert block, "the cost section has no inputs block"
    values = {}
    for line in block.group(1).splitlines():
        line = line.split("#", 1)[0].strip()
        if "=" in line:
            key, value = (x.strip() for x in line.split("=", 1))
            values[key] = float(value)
    return values


def _table_row(label: str) -> list[str]:
    for line in cost_section().splitlines():
        if line.startswith(f"| {label}"):
            return [c.strip() for c in line.strip().strip("|").split("|")]
    raise AssertionError(f"no cost table row starting with {label!r}")


def test_cost_section_has_no_placeholders():
    assert "TBD" not in README.read_text(), "infra/README.md still has TBD figures"


def test_cost_inputs_match_the_benchmarks_and_the_preset():
    v = cost_inputs()
    bench = " ".join(BENCHMARKS_PAGE.read_text().split())
    # measured: the worst end of docs/benchmarks.md's measured ranges, and the sum of the MC-evaluation ratios
    pass1 = re.search(r"\(KFAC \+ diagonal pass\) / \(forward \+ backward\)[^|]*\|[^|]*\| ([\d.]+)x – ([\d.]+)x", bench)
    efb = re.search(r"\(EFB pass\) / \(forward \+ backward\)[^|]*\|[^|]*\| ([\d.]+)x – ([\d.]+)x", bench)
    mc = re.search(r"\| INF ([\d.]+)x, Diag ([\d.]+)x, KFAC ([\d.]+)x, EFB ([\d.]+)x \|", bench)
    assert pass1 and efb and mc, "docs/benchmarks.md's benchmark table changed shape; update this test"
    assert v["rho_1"] == float(pass1.group(2)) and v["rho_2"] == float(efb.group(2))
    assert v["rho_mc"] == pytest.approx(sum(float(x) for x in mc.groups()), abs=1e-9)
    assert v["r_fwd"] == 3 * v["r_fb"]
    from jobs.imagenet_inf import config_from_args, get_args_parser

    cfg = config_from_args(get_args_parser().parse_args(["--preset", "imagenet-resnet50", "--data", "s3://YOUR-BUCKET/x"]))
    assert cfg.data.limit is None and v["N_tr"] == 1_281_167  # the full ImageNet-1k train set
    assert v["f"] == cfg.curvature.efb_fraction and v["S"] == cfg.search.num_configs
    assert v["K_s"] == cfg.search.mc_samples and v["N_s"] == cfg.data.val_limit
    assert v["K_mc"] == cfg.evaluate.mc_samples and v["N_ev"] == cfg.data.test_limit
    # rho_mc sums exactly these posteriors; the temperature row (every preset) adds one MAP forward pass per image
    assert [m for m in cfg.posterior.methods if m != "temperature"] == ["diag", "kfac", "efb", "inf"]
    assert "temperature" in cfg.posterior.methods


def test_cost_table_follows_from_its_inputs():
    v = cost_inputs()
    hours = {
        "Curvature pass 1": v["N_tr"] * v["rho_1"] / v["r_fb"] / 3600,
        "EFB pass 2": v["f"] * v["N_tr"] * v["rho_2"] / v["r_fb"] / 3600,
        "Search": v["S"] * v["K_s"] * v["N_s"] * v["rho_mc"] / v["r_fwd"] / 3600,
        "Evaluation": v["K_mc"] * (v["N_ev"] + v["N_ood"]) * v["rho_mc"] / v["r_fwd"] / 3600,
    }
    hours["Total"] = sum(hours.values())
    for label, h in hours.items():
        row = _table_row(label)
        assert row[3] == f"{h:.2f}", f"{label}: table says {row[3]} GPU-hours, the inputs give {h:.2f}"
        assert row[4] == f"${h * v['p_gpu']:.2f}", f"{label}: table says {row[4]}, the inputs give ${h * v['p_gpu']:.2f}"
    passes = {"Curvature pass 1": v["N_tr"], "EFB pass 2": v["N_tr"], "Search": 4 * v["S"] * v["K_s"] * v["N_s"],
              "Evaluation": 4 * v["K_mc"] * (v["N_ev"] + v["N_ood"])}
    for label, n in passes.items():
        assert _table_row(label)[1] == f"{int(n):,}", label


def _asha_chunk_configurations(n: int, steps: int, eta: int) -> int:
    """Chunk-configurations one method's search scores under promotion-based ASHA when every
    configuration reaches a rung before any is promoted: ``n`` score rung 0 (step 1), the best
    ``⌊n_k/η⌋`` go on to each next rung ``η^k < steps``, and at least one scores the rest."""
    rungs, s = [], 1
    while s < steps:
        rungs.append(s)
        s *= eta
    total, alive = 0, n
    for k, r in enumerate(rungs):
        total += alive * (r - (rungs[k - 1] if k else 0))
        alive = max(1, alive // eta) if k == len(rungs) - 1 else alive // eta
    return total + alive * (steps - rungs[-1])


def test_asha_rows_follow_from_the_promotion_count():
    """The ASHA rows: 100 configurations, 10,000 search images in chunks of 500 (20 steps),
    reduction factor 4: 100 + 25 x 3 + 6 x 12 + 1 x 4 = 251 of 2,000 chunk-configurations."""
    v = cost_inputs()
    steps = v["N_s"] // 500
    used = _asha_chunk_configurations(v["S"], steps, 4)
    assert (used, steps) == (251, 20)
    share = used / (v["S"] * steps)
    search = v["S"] * v["K_s"] * v["N_s"] * v["rho_mc"] / v["r_fwd"] / 3600
    rest = (v["N_tr"] * v["rho_1"] / v["r_fb"] + v["f"] * v["N_tr"] * v["rho_2"] / v["r_fb"]
            + v["K_mc"] * (v["N_ev"] + v["N_ood"]) * v["rho_mc"] / v["r_fwd"]) / 3600
    row, total = _table_row("ASHA search"), _table_row("ASHA total")
    assert row[1] == f"{int(4 * v['S'] * v['K_s'] * v['N_s'] * share):,}"
    assert row[3] == f"{search * share:.2f}" and row[4] == f"${search * share * v['p_gpu']:.2f}"
    assert total[3] == f"{rest + search * share:.2f}" and total[4] == f"${(rest + search * share) * v['p_gpu']:.2f}"


def test_resnet50_allreduce_bytes_are_exact():
    """The all-reduce payloads quoted for ResNet-50: float64 sums of A (n x n), G (m x m) and the
    diagonal (m x n) per covered layer (pass 1), the EFB sums (m x n, pass 2), and the eigenbasis
    broadcast; partitions = ceil(N_tr / data.partition_size)."""
    import math

    import torch
    import torchvision

    from jobs.imagenet_inf import config_from_args, get_args_parser
    from laplace_core.curvature.layers import find_layers

    with torch.device("meta"):
        model = torchvision.models.resnet50()
    _, infos, _ = find_layers(model)
    shapes = [tuple(i.shape) for i in infos.values()]
    a, g, d = (sum(n * n for m, n in shapes), sum(m * m for m, n in shapes), sum(m * n for m, n in shapes))
    basis = sum((n * n + n + m * m + m + 1) * 8 for m, n in shapes)
    text = " ".join(cost_section().split())
    assert f"{len(shapes)} covered layers" in text
    for figure in (a, g, d, a + g + d, 8 * (a + g + d), 8 * d, basis):
        assert f"{figure:,}" in text, f"{figure:,} not quoted in the cost section"
    cfg = config_from_args(get_args_parser().parse_args(["--preset", "imagenet-resnet50", "--data", "s3://YOUR-BUCKET/x"]))
    parts = math.ceil(cost_inputs()["N_tr"] / cfg.data.partition_size)
    assert f"there are {parts} partitions" in text
    assert f"{parts * 8 * (a + g + d) / 1e9:.1f} GB (pass 1)" in text and f"{parts * 8 * d / 1e9:.1f} GB (pass 2)" in text
    largest = max(max(s) for s in shapes)
    assert f"{largest} x {largest} factor" in text


def test_resnet50_interval_schedule_figures():
    """The 16-GPU figures of the per-interval reduce (``pipelines.distributed``), recomputed for the
    ``imagenet-resnet50`` preset: A and G as upper triangles, one reduce per
    ``curvature.checkpoint_every_s`` interval plus one at the end, at the cost section's rate
    (r_fb / rho_1 per worker, 16 workers); bytes all-reduced and written per pass are at most
    2 payloads + one per interval, and the reduce (ring, 1.875x the payload per link at
    10 Gbit/s) is under 5% of the modelled pass."""
    import math

    import torch
    import torchvision

    from jobs.imagenet_inf import config_from_args, get_args_parser
    from laplace_core.curvature.layers import find_layers

    with torch.device("meta"):
        model = torchvision.models.resnet50()
    _, infos, _ = find_layers(model)
    shapes = [tuple(i.shape) for i in infos.values()]
    a_p = sum(n * (n + 1) // 2 for m, n in shapes)
    g_p = sum(m * (m + 1) // 2 for m, n in shapes)
    d = sum(m * n for m, n in shapes)
    v = cost_inputs()
    cfg = config_from_args(get_args_parser().parse_args(["--preset", "imagenet-resnet50", "--data", "s3://YOUR-BUCKET/x"]))
    workers, interval = cfg.curvature.num_workers, cfg.curvature.checkpoint_every_s
    assert workers == 16 and interval == 600
    text = " ".join(cost_section().split())
    for figure in (a_p, g_p, a_p + g_p + d, 8 * (a_p + g_p + d)):
        assert f"{figure:,}" in text, f"{figure:,} not quoted in the cost section"
    rate = v["r_fb"] / v["rho_1"]
    compute_s = v["N_tr"] / (workers * rate)
    assert f"At {rate:.0f} img/s per worker" in text and f"a pass takes {compute_s:.0f} s on 16 workers" in text
    link = 10e9 / 8
    for payload, name, rho in ((8 * (a_p + g_p + d), "pass 1", v["rho_1"]), (8 * d, "pass 2", v["rho_2"])):
        compute_s = v["N_tr"] / (workers * v["r_fb"] / rho)
        reduces = math.floor(compute_s / interval) + 1
        assert reduces == 1 and "each pass makes **1 all-reduce**" in text
        allreduced = reduces * payload
        written = reduces * payload if name == "pass 1" else (reduces - 1) * payload
        assert allreduced <= 2 * payload + (compute_s // interval) * payload
        assert written <= 2 * payload + (compute_s // interval) * payload
        assert f"{allreduced / 1e9:.2f} GB ({name})" in text
        reduce_s = reduces * 2 * (workers - 1) / workers * payload / link
        share = reduce_s / (compute_s + reduce_s)
        assert share < 0.05, (name, share)
        assert f"{reduce_s:.1f} s" in text and f"{100 * share:.2f}%" in text, (name, reduce_s, share)
    assert f"Rank 0 writes {8 * (a_p + g_p + d) / 1e9:.2f} GB per pass 1" in text
