"""The documentation points at things that exist: every relative link of README.md, CHANGELOG.md and docs/*.md leads
to a file (and, with an anchor, to one of its headings), and every repository path the text names in backticks
exists."""

import re
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE = re.compile(r"`([^`\s]+)`")
# Top-level folders of the repository: a backticked name starting with one of them is a path the reader may open.
TOP = ("recipes/", "bench/", "tests/", "trl_longrm/", "accelerate_configs/", "docs/")


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    slugs = set()
    for line in page.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            slugs.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return slugs


def test_pages_exist():
    assert (ROOT / "docs").is_dir() and len(PAGES) > 5


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_lead_somewhere(page):
    text = page.read_text()
    for target in LINK.findall(text):
        if re.match(r"[a-z]+://", target) or target.startswith("mailto:"):
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        assert resolved.exists(), f"{page.name}: link to {target} ({resolved} does not exist)"
        if anchor and resolved.suffix == ".md":
            assert anchor in anchors(resolved), f"{page.name}: {target}: no heading with anchor #{anchor}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_named_paths_exist(page):
    missing = []
    for name in CODE.findall(page.read_text()):
        if not name.startswith(TOP) or any(c in name for c in "*{}<>$[]"):
            continue
        path = name.split(":")[0].rstrip(".,;)")
        if not (ROOT / path).exists():
            missing.append(name)
    assert not missing, f"{page.name} names paths that do not exist: {missing}"
