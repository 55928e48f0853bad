"""Every command in README.md and in the docs pages its text moved to (:func:`pages`: every
``docs/*.md`` but the design notes and conventions) is one that a test or CI runs, or (when it
needs a GPU cluster, S3 or minutes of benchmarking) at least one whose script exists and whose
arguments parse.

Commands are taken from those pages themselves: every line of a plain code block that starts
with a program (backslash continuations joined), every backticked command in the text and the
tables (``make demo``, ``python benchmarks/...``, ...), and the README's Python API block.
:data:`EXERCISED` maps each one to where it runs or how it is checked; a command missing from the
map, or an entry no page has any more, fails :func:`test_every_readme_command_is_mapped`. Figures
quoted beside a command are checked on the page that quotes them (``infoform sizes``: docs/methods.md).

| command (README.md or a docs page) | exercised by |
| --- | --- |
| ``make demo`` / ``python jobs/imagenet_inf.py`` | tests/jobs/test_demo_fresh.py (fresh clone, new venv; on in ``make test``) |
| ``make test`` | ``.ci/run`` (CI runs exactly ``make test``) |
| ``ray job submit ... --preset smoke ...``, ``ray start --head`` | tests/jobs/test_job.py (submits to a ``ray start --head`` on loopback, with a worker node; S3 on moto) |
| ``ray job submit ... --preset imagenet-resnet50 ... s3://`` | parse: Ray's own ``job submit`` CLI + the job's parser (dry run) |
| ``infoform sizes ...`` | run here (meta device, seconds); docs/methods.md's resnet18 figures checked |
| ``infoform run ...`` | run here with ``--dry-run``; the job itself in tests/jobs/test_job.py |
| ``make core-demo`` | parse: the Makefile target and ``jobs/core_demo.py``'s parser (minutes of CPU) |
| ``python benchmarks/*.py ...`` | parse: each script's own argparse with the page's arguments (benchmarks take minutes) |
| ``python benchmarks/paper/*.py ...`` | parse, as above; reduced versions run in tests/core/test_paper_table1.py and tests/pipelines/cli/test_paper_table2.py |
| Python API block | run here on a tiny CNN |

infra/README.md's commands are checked by tests/jobs/test_infra.py.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import re
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
#: docs pages with owners of their own, whose commands this file does not map (as before the move)
NOT_SCANNED = {"design.md", "conventions.md"}
#: the page that quotes ``infoform sizes``' figures
SIZES_PAGE = DOCS / "methods.md"
PROGRAMS = ("make", "python", "infoform", "ray", "pip")
SAMPLE_ENV = {"RAY_ADDRESS": "http://127.0.0.1:8265"}

def pages() -> list[Path]:
    """README.md and the docs pages its commands, figures and notes moved to."""
    return [README, *sorted(p for p in DOCS.glob("*.md") if p.name not in NOT_SCANNED)]


def _flat(path: Path) -> str:
    """The page's text with every run of whitespace made one space (figures split across lines)."""
    return " ".join(path.read_text(encoding="utf-8").split())


# Plain code blocks that hold no commands, by their first line.
NOT_COMMANDS = {
    "configs/                  presets: one YAML file per run shape (demo, smoke, imagenet-*, audit)": "the folder tree",
    "stats/passes/pass{1,2}/ckpt-NNNNNN/      running sums of the finished partitions (resume point; removed when the "
    "stage ends)": "the artifact layout",
    "my_data/train/<class>/*.jpg   the images the curvature is computed on (the training set, or part of it)":
        "the ImageFolder layout of the quick start",
}

# Command (README.md or a docs page) -> (kind, where / why). kind "run": a test or CI runs it (the needle ties it to
# that file); "here": a test in this file runs it; "parse": checked without running it.
EXERCISED: dict[str, tuple[str, str]] = {
    "make demo": ("run", "tests/jobs/test_demo_fresh.py"),
    "make test": ("run", ".ci/run"),
    "python jobs/imagenet_inf.py": ("run", "Makefile"),  # `make demo` runs it; test_demo_fresh runs make demo
    "ray job submit --address http://127.0.0.1:8265 --working-dir . -- python jobs/imagenet_inf.py --preset smoke "
    "--output s3://bucket/infoform-smoke --endpoint-url http://127.0.0.1:9000": ("run", "tests/jobs/test_job.py"),
    "ray job submit --address $RAY_ADDRESS --working-dir . --runtime-env infra/runtime_env.yaml -- python "
    "jobs/imagenet_inf.py --preset imagenet-resnet50 --data s3://bucket/imagenet --weights s3://bucket/resnet50.pt "
    "--output s3://bucket/runs/r50": ("parse", "needs a GPU cluster and S3: Ray's CLI + the job's parser"),
    "infoform sizes --model resnet18 --rank 100 --norm-layers map": ("here", "test_sizes_commands_run"),
    "infoform sizes --model densenet121 --json": ("here", "test_sizes_commands_run"),
    "infoform sizes --model timm:efficientnet_b0": ("here", "test_sizes_commands_run"),
    "infoform sizes --model resnet18 --layers last --norm-layers map": ("here", "test_sizes_commands_run"),
    "infoform sizes": ("here", "test_sizes_commands_run (the section heading)"),
    "infoform run ...": ("here", "test_infoform_run_is_the_job"),
    "infoform score": ("here", "test_infoform_score_parses (the section heading)"),
    "infoform score --run runs/smoke --data run:test --output runs/smoke-scores --method inf":
        ("here", "test_infoform_score_parses; run on a smoke run in tests/pipelines/serve/test_score.py"),
    "ray start --head": ("run", "tests/jobs/test_job.py"),
    "python jobs/imagenet_inf.py --data my_data --model resnet18 --weights my_model.pt":
        ("run", "tests/jobs/test_first_run.py"),
    "python jobs/imagenet_inf.py --data my_data --model timm:convnext_tiny --weights my_convnext.safetensors":
        ("parse", "needs a trained convnext_tiny; tests/pipelines/cli/test_timm_run.py runs timm models through the job"),
    "infoform config --list": ("run", "tests/pipelines/config/test_settings.py"),
    "make core-demo": ("parse", "minutes of CPU: the Makefile target and jobs/core_demo.py's parser"),
    "python benchmarks/core_pass.py --random-basis": ("parse", "benchmark"),
    "python benchmarks/sampling.py": ("parse", "benchmark"),
    "python benchmarks/search_cost.py --configs 24": ("parse", "benchmark"),
    "python benchmarks/search_cost.py --model resnet18 --size 64 --curvature-images 256": ("parse", "benchmark"),
    "python benchmarks/eval_overhead.py --model demo_cnn --size 64 --n-images 128 --batch-size 64 --threads 1":
        ("parse", "benchmark"),
    "python benchmarks/peers.py --model resnet18 --size 64 --batch 32 --batches 4": ("parse", "benchmark"),
    "python benchmarks/peers_kronfluence.py --size 64 --batch 32 --batches 8 --reps 3": ("parse", "benchmark"),
    "python benchmarks/scaling.py --images 12288 --size 64 --partitions 2 --workers 1 2":
        ("parse", "benchmark"),
    "python benchmarks/comm.py": ("parse", "benchmark (arithmetic; tests/jobs/test_infra.py recomputes ResNet-50's row)"),
    "python benchmarks/core_pass.py --model resnet50 --size 224 --batch 64 --device cuda":
        ("parse", "benchmark; needs a CUDA device"),
    "python benchmarks/eval_overhead.py --model resnet50 --size 224 --num-classes 1000 --n-images 256 "
    "--batch-size 64 --repeats 2 --device cuda": ("parse", "benchmark; needs a CUDA device"),
    "python benchmarks/gpu_check.py --out gpu_check.json": ("parse", "benchmark; needs a CUDA device (docs/benchmarks.md: "
                                                              "the device run)"),
    "python benchmarks/gpu_check.py --tiny --out tiny.json": ("run", "tests/benchmarks/test_gpu_check.py"),
    "python benchmarks/synth_imagenet.py /tmp/inet --classes 10 --per-class 800 --val-per-class 40":
        ("parse", "writes 8,400 JPEGs for the GPU throughput run"),
    "python jobs/imagenet_inf.py --preset imagenet-resnet50 --data /tmp/inet --weights /tmp/r50.pt --set "
    "curvature.num_workers=1 --set data.partition_size=4000 --set data.val_limit=200 --set data.test_limit=200 "
    "--set search.num_configs=2 --set search.mc_samples=2 --set evaluate.mc_samples=4 --set evaluate.num_actors=2 "
    "--set evaluate.gpus_per_actor=0.5":
        ("parse", "the GPU throughput run: needs a CUDA device and the synthetic tree"),
    "<python API block>": ("here", "test_python_api_block_runs"),
    "python benchmarks/paper/table1.py --splits 20": ("parse", "benchmark (minutes); tests/core/test_paper_table1.py runs 2 splits"),
    "python benchmarks/paper/figure4.py": ("parse", "benchmark (a minute)"),
    "python benchmarks/paper/table2.py --configs 20 --search-mc 5 --eval-mc 20 --epochs 40 --members 5 "
    "--per-class 100 100 100 --letters 50": ("parse", "benchmark (the job end to end); "
                                             "tests/pipelines/cli/test_paper_table2.py runs a smaller one"),
    "python benchmarks/paper/table2.py --configs 300": ("parse", "the paper's 300 configurations (not run here: hours "
                                                         "on 2 shared cores)"),
}

# For "run" entries: a fragment of the runner's source that shows it runs the command.
RUNNER_NEEDLES = {
    "make demo": '["make", "demo"]',
    "make test": "make test",
    "python jobs/imagenet_inf.py": "$(PY) jobs/imagenet_inf.py",
    "ray start --head": '"start", "--head"',
    "python jobs/imagenet_inf.py --data my_data --model resnet18 --weights my_model.pt":
        'QUICK_START = ["--data", "my_data", "--model", "resnet18", "--weights", "my_model.pt"]',
    "infoform config --list": 'main(["config", "--list"])',
    "python benchmarks/gpu_check.py --tiny --out tiny.json": '["--tiny", "--out"',
}


# --------------------------------------------------------------------------- extraction
def _blocks(text: str) -> list[tuple[str, str]]:
    """``(language, body)`` of every fenced code block."""
    return re.findall(r"^```([\w-]*)\n(.*?)^```", text, flags=re.S | re.M)


def readme_commands() -> dict[str, str]:
    """Normalised command -> the page (README.md or a docs page) where it was found."""
    found: dict[str, str] = {}
    for page in pages():
        for cmd, where in _page_commands(page).items():
            found.setdefault(cmd, where)
    return found


def _page_commands(page: Path) -> dict[str, str]:
    text = page.read_text(encoding="utf-8")
    name = str(page.relative_to(ROOT))
    found: dict[str, str] = {}
    for lang, body in _blocks(text):
        if lang == "python":
            found["<python API block>" if page == README else f"<python block in {name}>"] = name
            continue
        assert lang in ("", "bash", "sh", "text"), f"{name}: code block in an unexpected language {lang!r}"
        first = body.splitlines()[0].strip() if body.strip() else ""
        if first in NOT_COMMANDS:
            continue
        joined = re.sub(r"\\\n\s*", " ", body)
        for line in joined.splitlines():
            line = line.split(" #", 1)[0].strip()
            if not line:
                continue
            assert line.split()[0] in PROGRAMS, (f"{name}: code block line {line!r} is neither a command nor in a "
                                                 "block listed in NOT_COMMANDS")
            found[" ".join(line.split())] = f"{name} code block"
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    for span in re.findall(r"`([^`\n]+)`", prose):
        if span.split()[0] in PROGRAMS and not span.startswith("python -m pytest"):
            found.setdefault(" ".join(span.split()), f"{name} inline")
    return found


def _substitute(cmd: str) -> str:
    return re.sub(r"\$(\w+)", lambda m: SAMPLE_ENV[m.group(1)], cmd)


def _entrypoint(cmd: str) -> tuple[list[str], list[str]]:
    """``ray job submit OPTIONS -- python SCRIPT ARGS`` -> (OPTIONS, [SCRIPT, *ARGS])."""
    tokens = shlex.split(_substitute(cmd))
    assert tokens[:3] == ["ray", "job", "submit"] and "--" in tokens, cmd
    i = tokens.index("--")
    assert tokens[i + 1] == "python", cmd
    return tokens[3:i], tokens[i + 2:]


def _load_script(path: Path):
    name = "readme_cmd_" + re.sub(r"\W", "_", str(path.relative_to(ROOT)))
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


class _Parsed(Exception):
    def __init__(self, ns):
        self.ns = ns


def _parse_only(monkeypatch, call) -> argparse.Namespace:
    """Run ``call()`` but stop right after its argparse parsed the arguments (a bad argument
    makes argparse exit 2, reported as a failure)."""
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise _Parsed(original(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    try:
        call()
    except _Parsed as p:
        return p.ns
    except SystemExit as e:
        pytest.fail(f"arguments do not parse (exit {e.code})")
    finally:
        monkeypatch.setattr(argparse.ArgumentParser, "parse_args", original)
    pytest.fail("the script returned without parsing any arguments")


# --------------------------------------------------------------------------- the map
def test_every_readme_command_is_mapped():
    found = readme_commands()
    unmapped = sorted(set(found) - set(EXERCISED))
    assert not unmapped, ("commands in README.md / docs pages with no test or check (add them to EXERCISED): "
                          f"{[(c, found[c]) for c in unmapped]}")
    stale = sorted(set(EXERCISED) - set(found))
    assert not stale, f"EXERCISED lists commands neither README.md nor a docs page has any more: {stale}"


@pytest.mark.parametrize("cmd", [c for c, (k, _) in EXERCISED.items() if k == "run"])
def test_run_entries_name_a_runner_that_runs_them(cmd):
    runner = ROOT / EXERCISED[cmd][1]
    assert runner.is_file(), runner
    source = runner.read_text(encoding="utf-8")
    if cmd.startswith("ray job submit"):
        # test_job.py submits the same entrypoint (its own --output) with the same ray options
        # (its head's address; --runtime-env-json excludes .venv/.git/runs from the upload)
        ray_opts, entry = _entrypoint(cmd)
        assert '"job", "submit"' in source and '"--working-dir"' in source
        i = entry.index("--output")
        fragment = ", ".join(json.dumps(t) for t in ["python", *entry[: i + 1]])
        assert fragment in source, f"{runner.name} does not submit {fragment}"
        assert ray_opts[0] == "--address" and ray_opts[1].startswith("http://127.0.0.1:")
        return
    assert RUNNER_NEEDLES[cmd] in source, f"{runner.name} does not run {cmd!r}"
    if runner.name == "Makefile" and cmd == "python jobs/imagenet_inf.py":
        assert '["make", "demo"]' in (ROOT / "tests/jobs/test_demo_fresh.py").read_text()


def test_ci_runs_make_test_which_runs_pytest():
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^make test$", ci, flags=re.M)
    assert re.search(r"^test: .*\n\t(\w+=\S+ )*\$\(PY\) -m pytest", (ROOT / "Makefile").read_text(), flags=re.M)


# --------------------------------------------------------------------------- run here
def test_sizes_commands_run(capsys):
    from pipelines.cli.main import main

    assert main(["sizes", "--model", "resnet18", "--rank", "100", "--norm-layers", "map"]) == 0
    out = capsys.readouterr().out
    # the figures docs/methods.md quotes for resnet18 (Lee et al. 2020, Table 3)
    for figure in ("11,679,912", "44.6", "362.4", "407.0"):
        assert figure in out, (figure, out)
    for claim in ("Diag 11,679,912 numbers", "= 44.6 MB", "KFAC 362.4 MB", "EFB 407.0 MB"):
        assert claim in _flat(SIZES_PAGE)
    assert main(["sizes", "--model", "densenet121", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert "diag" in json.dumps(report)
    assert main(["sizes", "--model", "vit_b_16", "--norm-layers", "diag", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert round(100 * report["coverage"]["fraction"], 2) == 100.0  # the figure docs/methods.md quotes
    assert report["coverage"]["weights_at_map"] == 0 and "vit_b_16 100.00%" in _flat(SIZES_PAGE)
    assert main(["sizes", "--model", "timm:efficientnet_b0"]) == 0  # the default: norm layers under the diagonal
    assert "coverage: 100.00% of 5,288,548 parameters under the posterior (norm layers: diag)" in capsys.readouterr().out
    assert main(["sizes", "--model", "resnet18", "--layers", "last", "--norm-layers", "map"]) == 0
    out = capsys.readouterr().out
    for figure in ("513,000", "1,263,169", "4.39%"):  # the figures docs/methods.md quotes for the fc-only posterior
        assert figure in out, (figure, out)
    assert "Diag 513,000 numbers (2.0 MB), KFAC 1,263,169 (4.8 MB), 4.39%" in _flat(SIZES_PAGE)


def test_infoform_run_is_the_job(capsys):
    from pipelines.cli.main import main

    assert main(["run", "--preset", "smoke", "--dry-run"]) == 0
    assert "preset: smoke" in capsys.readouterr().out


def test_infoform_score_parses():
    """README's ``infoform score`` lines parse; tests/pipelines/serve/test_score.py runs the command (and
    README's ``load_run`` block) on a smoke run."""
    from pipelines.cli.main import build_parser

    cmds = [c for c in EXERCISED if c.startswith("infoform score ")]
    assert cmds
    for cmd in cmds:
        ns = build_parser().parse_args(shlex.split(cmd)[1:])
        assert ns.command == "score" and ns.run and ns.data and ns.output
    assert "test_readme_load_run_example_runs" in (ROOT / "tests/pipelines/serve/test_score.py").read_text()


def test_python_api_block_runs(tmp_path, monkeypatch):
    """The README's Python API block, verbatim, on a tiny CNN with 2 batches of 8 images."""
    import torch

    from pipelines.ingest.models import tiny_cnn

    block = next(body for lang, body in _blocks(README.read_text(encoding="utf-8")) if lang == "python")
    g = torch.Generator().manual_seed(1)
    model = tiny_cnn(3).eval()
    batches = [(torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(2)]
    x = torch.randn(4, 3, 8, 8, generator=g)
    monkeypatch.chdir(tmp_path)  # the block saves to runs/x/posterior/inf
    ns = {"model": model, "batches": batches, "x": x}
    exec(compile(block, "README.md:python", "exec"), ns)
    post, probs = ns["post"], ns["probs"]
    assert post.method == "inf"
    assert probs.shape == (4, 3) and torch.allclose(probs.sum(-1), torch.ones(4, dtype=probs.dtype), atol=1e-5)
    deltas = ns["deltas"]
    assert deltas and all(d.shape[0] == 1 for d in deltas.values())
    assert (tmp_path / "runs" / "x" / "posterior" / "inf").is_dir()


# --------------------------------------------------------------------------- parse only
def test_cluster_submission_parses():
    from ray.dashboard.modules.job.cli import job_cli_group

    from pipelines.cli.main import config_from_args, get_args_parser

    cmds = [c for c, (k, _) in EXERCISED.items() if k == "parse" and c.startswith("ray job submit")]
    assert cmds
    for cmd in cmds:
        ray_opts, entry = _entrypoint(cmd)
        ctx = job_cli_group.commands["submit"].make_context("submit", [*ray_opts, "--", "python", *entry])
        if ctx.params.get("runtime_env"):
            assert (ROOT / ctx.params["runtime_env"]).is_file(), ctx.params["runtime_env"]
        assert (ROOT / entry[0]).is_file() and entry[0] == "jobs/imagenet_inf.py"
        ns = get_args_parser().parse_args(entry[1:])
        assert "dry_run" in vars(ns)  # the job has a parse-only mode
        cfg = config_from_args(ns)
        assert cfg.output.startswith("s3://") and cfg.data.root.startswith("s3://") and not cfg.data.demo
        assert cfg.model.weights and cfg.model.weights.startswith("s3://")


def test_make_core_demo_parses(monkeypatch):
    make = (ROOT / "Makefile").read_text()
    m = re.search(r"^core-demo: .*\n\t(.+)$", make, flags=re.M)
    assert m and m.group(1).strip() == "$(PY) jobs/core_demo.py", m
    mod = _load_script(ROOT / "jobs" / "core_demo.py")
    ns = mod.get_args_parser().parse_args([])
    assert ns.workdir and ns.rank >= 1


@pytest.mark.parametrize("cmd", [c for c in EXERCISED if c.startswith("python benchmarks/")])
def test_benchmark_commands_parse(cmd, monkeypatch):
    tokens = shlex.split(cmd)
    script = ROOT / tokens[1]
    assert script.is_file(), script
    args = tokens[2:]
    source = script.read_text(encoding="utf-8")
    if "argparse" not in source:  # a plain script: it must not expect arguments
        assert not args and "sys.argv" not in source, cmd
        compile(source, str(script), "exec")
        return
    mod = _load_script(script)
    assert callable(getattr(mod, "main", None)), f"{script.name} has no main()"
    ns = _parse_only(monkeypatch, lambda: mod.main(args))
    for flag in (t for t in args if t.startswith("--")):
        assert hasattr(ns, flag[2:].replace("-", "_")), (cmd, flag)
