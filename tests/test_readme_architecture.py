"""README's "Architecture" section: the folder tree, one line per folder, in data-flow order.

Every path it names exists, every stage folder of ``pipelines/`` is named, in the order the
data flows; and every repository path the README names in backticks exists.
"""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
#: the stages in the order the data flows (the folder names of pipelines/)
DATA_FLOW = ("cli", "config", "storage", "ingest", "distributed", "passes", "evaluation", "report")


def _tree() -> list[tuple[str, str]]:
    section = README.split("\n## Architecture\n", 1)[1].split("\n## ", 1)[0]
    block = section.split("```", 2)[1]
    rows = []
    for line in block.strip("\n").splitlines():
        path, _, what = line.partition(" ")
        rows.append((path, what.strip()))
    return rows


def test_every_folder_in_the_tree_exists_and_says_what_it_holds():
    rows = _tree()
    assert len(rows) >= 10
    for path, what in rows:
        assert path.endswith("/") and (ROOT / path).is_dir(), path
        assert len(what.split()) >= 3, f"{path}: one line saying what the folder holds"


def test_the_pipeline_folders_are_all_named_in_data_flow_order():
    named = [p.split("/")[1] for p, _ in _tree() if p.startswith("pipelines/")]
    on_disk = {p.name for p in (ROOT / "pipelines").iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert set(named) == on_disk
    assert named == [s for s in DATA_FLOW if s in named]


def test_every_repository_path_the_readme_names_exists():
    paths = set(re.findall(r"`((?:pipelines|laplace_core|tests|benchmarks|jobs|infra|configs|docs)/[\w/.\-]*)`", README))
    assert len(paths) > 10
    missing = sorted(p for p in paths if not (ROOT / p.rstrip("/")).exists() and "*" not in p)
    assert missing == []
