"""README's "Architecture" section: the folder tree, one line per folder, in data-flow order.

Every path it names exists, every stage folder of ``pipelines/`` is named, in the order the
data flows; and every repository path the README or a docs page it links names in backticks
exists. The README stays a front door (at most :data:`MAX_README_LINES` lines): every docs page
it links exists, opens with what it is for, and every relative link in them resolves (anchors
included).
"""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
DOCS = ROOT / "docs"
#: issue 30, acceptance 5
MAX_README_LINES = 220
#: docs pages with owners of their own (the design notes, the conventions), kept as they are
NOT_SCANNED = {"design.md", "conventions.md"}
#: the packages of pipelines/ lowest layer first, as pipelines.LAYERS orders them (the import
#: direction, checked by tests/test_structure.py)
from pipelines import LAYERS  # noqa: E402

DATA_FLOW = tuple(name for layer in LAYERS for name in layer)


def _pages() -> list[Path]:
    """README.md and the docs pages its text moved to."""
    return [ROOT / "README.md", *sorted(p for p in DOCS.glob("*.md") if p.name not in NOT_SCANNED)]


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
        if path == "pipelines/*.py":  # the top-level modules below every package
            assert list((ROOT / "pipelines").glob("*.py")), path
            continue
        assert path.endswith("/") and (ROOT / path).is_dir(), path
        assert len(what.split()) >= 3, f"{path}: one line saying what the folder holds"


def test_the_pipeline_folders_are_all_named_in_data_flow_order():
    named = [p.split("/")[1] for p, _ in _tree() if p.startswith("pipelines/") and p.endswith("/")]
    on_disk = {p.name for p in (ROOT / "pipelines").iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert set(named) == on_disk
    assert named == [s for s in DATA_FLOW if s in named]


def test_every_repository_path_the_readme_names_exists():
    pattern = r"`((?:pipelines|laplace_core|tests|benchmarks|jobs|infra|configs|docs)/[\w/.\-]*)`"
    paths = {(page.name, p) for page in _pages() for p in re.findall(pattern, page.read_text())}
    assert len(paths) > 10
    missing = sorted((page, p) for page, p in paths if not (ROOT / p.rstrip("/")).exists() and "*" not in p)
    assert missing == []


# --------------------------------------------------------------------------- the front door
def _slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    return {_slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, flags=re.M)}


def _links(page: Path) -> list[str]:
    """Relative link targets of a page (not http(s)/mailto, not in code blocks)."""
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    return [t for t in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"(https?|mailto):", t)]


def test_readme_is_a_front_door():
    lines = README.count("\n") + (not README.endswith("\n"))
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines; at most {MAX_README_LINES} (move detail to docs/)"


def test_every_docs_page_the_readme_links_exists_and_every_page_is_linked():
    linked = {t.split("#", 1)[0] for t in _links(ROOT / "README.md") if t.startswith("docs/")}
    assert {"docs/design.md", "docs/first-run.md"} <= linked and len(linked) >= 6, linked
    missing = sorted(t for t in linked if not (ROOT / t).is_file())
    assert missing == [], f"README.md links docs pages that do not exist: {missing}"
    orphans = sorted(f"docs/{p.name}" for p in DOCS.glob("*.md") if f"docs/{p.name}" not in linked)
    assert orphans == [], f"docs pages the README does not link: {orphans}"


def test_every_relative_link_resolves_with_its_anchor():
    bad = []
    for page in _pages():
        for target in _links(page):
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                bad.append((page.name, target, "no such file"))
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                bad.append((page.name, target, "no such heading"))
    assert bad == []


def test_every_docs_page_opens_with_what_it_is_for():
    for page in _pages()[1:]:
        blocks = [b.strip() for b in page.read_text().split("\n\n") if b.strip()]
        assert blocks[0].startswith("# ") and "\n" not in blocks[0], f"{page.name}: a one-line '# title' first"
        intro = blocks[1]
        assert not intro.startswith(("#", "-", "|", "```", "!", "<")), f"{page.name}: open with a sentence, not {intro[:20]!r}"
        assert intro.rstrip().endswith(".") and len(intro.split()) >= 12, f"{page.name}: say what the page is for"
