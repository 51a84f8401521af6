"""The documentation points at things that exist and its marked examples run: every relative link of README.md,
CHANGELOG.md and docs/*.md leads to a file (and, with an anchor, to one of its headings), every repository path the
text names in backticks exists, and every code block after a `<!-- runnable: SETUP -->` line runs on tiny models
prepared by the setup of that name."""

import re
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE = re.compile(r"`([^`\s]+)`")
# Top-level folders of the repository: a backticked name starting with one of them is a path the reader may open.
TOP = ("recipes/", "bench/", "tests/", "trl_longrm/", "accelerate_configs/", "docs/", ".ci/")


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


RUNNABLE = re.compile(r"<!-- runnable: (\w+) -->\n```python\n(.*?)```", re.S)


def runnable_blocks():
    return [(page, setup, code) for page in PAGES for setup, code in RUNNABLE.findall(page.read_text())]


def setup_disrm(tmp_path):
    """A saved DisRM (a tiny sequence classifier whose pad token is not its EOS) at `./disrm`, a conversation and two
    responses: what the scoring snippet of a DisRM's model card reads."""
    from trl_longrm.testing_utils import build_chat_tokenizer, save_tiny_model

    save_tiny_model(tmp_path / "disrm", task="seq-cls", tokenizer=build_chat_tokenizer(), seed=3)
    prompt = [{"role": "system", "content": "Judge."}, {"role": "user", "content": "Is the river long?"}]
    return {"prompt": prompt, "responses": ["Yes, very long.", "No."]}


SETUPS = {"disrm": setup_disrm}


def test_runnable_blocks_are_marked():
    assert runnable_blocks(), "no code block is marked runnable"


@pytest.mark.parametrize("page,setup,code", runnable_blocks(), ids=lambda v: getattr(v, "name", str(v)[:20]))
def test_runnable_blocks_run(page, setup, code, tmp_path, monkeypatch):
    import torch

    monkeypatch.chdir(tmp_path)
    namespace = SETUPS[setup](tmp_path)
    exec(compile(code, f"{page.name} (runnable: {setup})", "exec"), namespace)
    if setup == "disrm":  # one score per response, each the score of the response alone (padding read correctly)
        scores = namespace["scores"]
        assert scores.shape == (len(namespace["responses"]),) and torch.isfinite(scores).all()
        tokenizer, model = namespace["tokenizer"], namespace["model"]
        for text, score in zip(namespace["texts"], scores):
            alone = tokenizer(text, add_special_tokens=False, return_tensors="pt")
            with torch.no_grad():
                torch.testing.assert_close(model(**alone).logits[0, 0], score, rtol=1e-4, atol=1e-5)


def test_demo_figures_are_the_generated_table():
    """README's and docs/demo.md's `make demo` figures are the table `bench/demo_figures.py` renders from its record
    (regenerate with `python bench/demo_figures.py --docs --from bench/results/demo_figures.json`)."""
    import json
    import sys

    sys.path.insert(0, str(ROOT / "bench"))
    from demo_figures import DOC_FILES, MARKERS, render_table

    record = json.loads((ROOT / "bench" / "results" / "demo_figures.json").read_text())
    assert {run["profile"] for run in record["runs"]} == {"native", "avx2"}
    for path in DOC_FILES:
        text = path.read_text()
        start, end = (text.index(marker) for marker in MARKERS)
        assert text[start + len(MARKERS[0]) : end].strip() == render_table(record).strip(), path
