"""One owner per setting, one way between stages (issue 30, acceptance 1 and 4), read with ``ast``:

* every config key is written once: in its section class under ``pipelines/config/`` (a field
  ``= setting(...)``), never twice in a class, and no other class in ``pipelines/`` that mirrors
  a section (shares :data:`MIRROR` or more of its field names, or subclasses it) writes a
  default for one of its keys again (it takes it with ``same_as(Section, "name")``);
* ``ModelRun`` sets no attribute outside ``__init__``: the stages hand their results on as
  return values.

Each checker is also run on a planted source, to show that it can fail.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: a class sharing this many field names with a config section mirrors it
MIRROR = 3
#: (class, field): a default that is not the section's on purpose, and why
DIFFERENT_ON_PURPOSE = {
    ("DataConfig", "mean"): "the resolved value of data.mean's null (IMAGENET_MEAN, written once)",
    ("DataConfig", "std"): "the resolved value of data.std's null (IMAGENET_STD, written once)",
    ("DataConfig", "partition_size"): "per split: unset unless the plan partitions that split",
    ("DataConfig", "extensions"): "the suffixes indexed: the image suffixes widened by data.extensions (set by the plan)",
}


def _fields(cls: ast.ClassDef) -> list[tuple[str, ast.expr | None]]:
    return [(s.target.id, s.value) for s in cls.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]


def _call_name(node: ast.expr | None) -> str | None:
    if isinstance(node, ast.Call):
        return getattr(node.func, "id", None) or getattr(node.func, "attr", None)
    return None


def _classes(source: str) -> list[ast.ClassDef]:
    return [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef)]


def duplicate_settings(config_sources: dict[str, str], other_sources: dict[str, str]) -> list[str]:
    """Each place a config key is written a second time, as ``path: Class.field (why)``."""
    problems, sections = [], {}
    for path, source in config_sources.items():
        for cls in _classes(source):
            names = [name for name, value in _fields(cls) if _call_name(value) == "setting"]
            if names:
                sections[cls.name] = set(names)
            for name in {n for n in names if names.count(n) > 1}:
                problems.append(f"{path}: {cls.name}.{name} (written twice in its section)")
    for path, source in other_sources.items():
        for cls in _classes(source):
            if cls.name in sections:
                continue
            bases = {getattr(b, "id", None) for b in cls.bases}
            written = {name for name, value in _fields(cls)
                       if value is not None and _call_name(value) not in ("same_as", "field")}
            for section, keys in sections.items():
                if section in bases or len(keys & {name for name, _ in _fields(cls)}) >= MIRROR:
                    for name in sorted(keys & written):
                        if (cls.name, name) not in DIFFERENT_ON_PURPOSE:
                            problems.append(f"{path}: {cls.name}.{name} (a default of {section}.{name} again)")
    return problems


def _sources(folder: str, exclude: str | None = None) -> dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text() for p in sorted((ROOT / folder).rglob("*.py"))
            if exclude is None or exclude not in p.relative_to(ROOT).parts}


def test_every_config_key_is_written_once():
    config = _sources("pipelines/config")
    assert duplicate_settings(config, _sources("pipelines", exclude="config")) == []


def test_every_section_of_the_tree_writes_its_keys_with_setting():
    import dataclasses
    import typing

    from pipelines.config.schema import RunConfig
    from pipelines.config.settings import section_types

    tree, todo = set(), [RunConfig]
    while todo:
        cls = todo.pop()
        tree.add(cls.__name__)
        hints = typing.get_type_hints(cls)
        todo += [sub for f in dataclasses.fields(cls) for sub in section_types(hints[f.name])
                 if sub.__name__ not in tree]
    schema = [c for c in _classes((ROOT / "pipelines/config/schema.py").read_text()) if c.name in tree]
    assert {c.name for c in schema} == tree
    assert [f"{c.name}.{name}" for c in schema for name, value in _fields(c) if _call_name(value) != "setting"] == []


PLANTED_SECTION = '''
@dataclass(frozen=True)
class SearchSpec(Checked):
    num_configs: int = setting(100, "configurations", range="[1, inf)")
    mc_samples: int = setting(10, "K", range="[1, inf)")
    seed: int = setting(0, "seed", range="[0, inf)")
    mc_samples: int = setting(10, "K again", range="[1, inf)")
'''
PLANTED_RUNTIME = '''
@dataclass(frozen=True)
class SearchConfig:
    num_configs: int = 100
    mc_samples: int = 10
    seed: int = 0
    configs: tuple | None = None


@dataclass(frozen=True)
class Subclassed(SearchSpec):
    seed: int = 0
    device: str | None = None


@dataclass(frozen=True)
class TakesOne:
    num_configs: int = same_as(SearchSpec, "num_configs")
    mc_samples: int = same_as(SearchSpec, "mc_samples")
    seed: int = same_as(SearchSpec, "seed")
'''


def test_the_duplicate_checker_sees_a_planted_duplicate():
    got = duplicate_settings({"schema.py": PLANTED_SECTION}, {"runtime.py": PLANTED_RUNTIME})
    assert got == ["schema.py: SearchSpec.mc_samples (written twice in its section)",
                   "runtime.py: SearchConfig.mc_samples (a default of SearchSpec.mc_samples again)",
                   "runtime.py: SearchConfig.num_configs (a default of SearchSpec.num_configs again)",
                   "runtime.py: SearchConfig.seed (a default of SearchSpec.seed again)",
                   "runtime.py: Subclassed.seed (a default of SearchSpec.seed again)"]


def attributes_set_outside_init(source: str, class_name: str) -> list[str]:
    """``method: self.name`` for each attribute a method other than ``__init__`` sets
    (assignment, augmented or annotated assignment, ``setattr(self, ...)``)."""
    out = []
    for cls in _classes(source):
        if cls.name != class_name:
            continue
        for fn in cls.body:
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or fn.name == "__init__":
                continue
            for node in ast.walk(fn):
                targets = []
                if isinstance(node, ast.Assign):
                    targets = node.targets
                elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                    targets = [node.target]
                elif _call_name(node) == "setattr" and getattr(node.args[0], "id", None) == "self":
                    out.append(f"{fn.name}: setattr(self, ...)")
                for t in targets:
                    for sub in ast.walk(t):
                        if isinstance(sub, ast.Attribute) and getattr(sub.value, "id", None) == "self":
                            out.append(f"{fn.name}: self.{sub.attr}")
    return out


def test_model_run_sets_no_attribute_outside_init():
    source = (ROOT / "pipelines/cli/model_run.py").read_text()
    assert "class ModelRun" in source
    assert attributes_set_outside_init(source, "ModelRun") == []


def test_the_attribute_checker_sees_planted_side_effects():
    planted = '''
class ModelRun:
    def __init__(self):
        self.cfg = 1

    def curvature(self):
        self.curv_fp = {}
        self.seconds += 1.0
        local = self.cfg
        return local

    def search(self):
        setattr(self, "hyper", None)
        self.hyper_by, other = {}, 2
'''
    assert sorted(attributes_set_outside_init(planted, "ModelRun")) == [
        "curvature: self.curv_fp", "curvature: self.seconds", "search: self.hyper_by", "search: setattr(self, ...)"]
