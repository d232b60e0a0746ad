"""The README and docs/ show what the repository holds: the README's Python example runs as
written, every docs page is linked from the README, the links, file paths, module names and
section references in the README and docs/ point at things that exist, and the test counts they
give are the ones pytest collects. Only the example trains; one test collects the suite (no test
runs); the rest reads text."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
BENCHMARKS = [ROOT / "benchmarks" / "BENCHMARKS.md", *sorted((ROOT / "benchmarks" / "results").glob("*.md"))]
OTHER_TEXTS = [*BENCHMARKS, ROOT / "slurm" / "README.md"]  # paths checked too


def _rel(page: Path) -> str:
    return str(page.relative_to(ROOT))


def test_python_example_runs(tmp_path):
    text = README.read_text()
    section = text[text.index("## Python"):]
    code = re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                       check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    test_ap, shapes = r.stdout.strip().splitlines()[-2:]
    assert 0.5 < float(test_ap) <= 1
    assert shapes == "torch.Size([59835, 100]) torch.Size([5, 100])"  # every CollegeMsg event; 5 queries
    assert (tmp_path / "runs" / "jodie" / "checkpoints" / "last.pt").exists()


def test_docs_python_examples_run(tmp_path):
    """Every ```python block in docs/ runs (the README's is run above); none is there today."""
    for page in sorted(DOCS.glob("*.md")):
        for n, code in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(), re.DOTALL)):
            r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                               timeout=600, check=False)
            assert r.returncode == 0, f"{_rel(page)}, Python block {n + 1}: {r.stderr[-2000:]}"


def test_readme_stays_a_front_door():
    """Under 10 KB, with the sections issue 24 names; the reference lives in docs/."""
    text = README.read_text()
    assert len(text.encode()) < 10_000, f"README.md is {len(text.encode())} bytes: move reference material to docs/"
    for heading in ("## Set-up: the two commands", "## Training", "## Parallel launch", "## Python", "## Layout",
                    "## Documentation"):
        assert f"\n{heading}\n" in text, heading
    assert "make train" in text and "make test" in text and "torch==2.13.0" in text


def test_every_docs_page_is_linked_from_the_readme_and_exists():
    linked = set(re.findall(r"\]\((docs/[\w.-]+\.md)(?:#[\w-]+)?\)", README.read_text()))
    pages = {f"docs/{p.name}" for p in DOCS.glob("*.md")}
    assert pages, "docs/ holds no pages"
    assert not linked - pages, f"README links to missing pages: {sorted(linked - pages)}"
    assert not pages - linked, f"docs pages the README does not link to: {sorted(pages - linked)}"
    assert "](benchmarks/BENCHMARKS.md)" in README.read_text()


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _headings(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)  # not the comments of code blocks
    return [h.strip() for h in re.findall(r"^#+ (.+)$", text, re.MULTILINE)]


def _target(page: Path, name: str) -> Path:
    """A page named in ``page``: relative to it, else (a bare ``training.md`` in docs/) to docs/ or the root."""
    for base in (page.parent, DOCS, ROOT):
        if (base / name).exists():
            return (base / name).resolve()
    return page.parent / name


@pytest.mark.parametrize("page", PAGES + BENCHMARKS, ids=_rel)  # the headline table's links into results/ too
def test_links_and_anchors_resolve(page):
    for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]+))?\)", page.read_text()):
        if target.startswith(("http://", "https://")):
            continue
        path = (page.parent / target).resolve() if target else page  # as GitHub resolves it: from the page
        assert path.exists(), f"{_rel(page)} links to {target}, which does not exist"
        if anchor and path.suffix == ".md":
            assert anchor in {_slug(h) for h in _headings(path)}, f"{_rel(page)}: no heading for #{anchor} in {target}"


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_section_references_name_real_headings(page):
    """``other.md`` references, and ``other.md``, "Heading" ones, name a page and a heading it has."""
    text = page.read_text()
    for name in set(re.findall(r"`((?:\.\./)?[\w/-]+\.md)`", text)):
        assert _target(page, name).exists(), f"{_rel(page)} names {name}, which does not exist"
    for name, heading in re.findall(r"`((?:\.\./)?[\w/-]+\.md)`,\s+\"([^\"]+)\"", text):
        heading = " ".join(heading.split())  # a heading named across a line break
        assert heading in _headings(_target(page, name)), f"{_rel(page)}: {name} has no section \"{heading}\""


@pytest.mark.parametrize("page", PAGES + OTHER_TEXTS, ids=_rel)
def test_paths_and_modules_exist(page):
    """Repository paths (``tgdist/data/graph.py``, ``slurm/...``) and dotted names
    (``tgdist.runtime.run.run``) in the page point at files, folders and definitions that exist."""
    text = page.read_text()
    for path in set(re.findall(r"(?<![\w./-])((?:tgdist|benchmarks|scripts|slurm|tests|configs)/[\w./-]*[\w/])", text)):
        assert (ROOT / path).exists(), f"{_rel(page)} names {path}, which does not exist"
    for dotted in set(re.findall(r"(?<![\w.])(tgdist(?:\.\w+)+)", text)):
        parts = dotted.split(".")
        for n in range(len(parts), 0, -1):  # the longest prefix that is a module or package
            base = ROOT.joinpath(*parts[:n])
            module = base.with_suffix(".py") if base.with_suffix(".py").exists() else base / "__init__.py"
            if module.exists():
                break
        else:
            pytest.fail(f"{_rel(page)} names {dotted}: no module tgdist found")
        rest = parts[n:]
        assert len(rest) <= 1, f"{_rel(page)} names {dotted}: {'.'.join(parts[:n])} has no module {rest[0]}"
        if rest:
            source = module.read_text()
            assert re.search(rf"^(?:def|class) {rest[0]}\b|^{rest[0]}\s*[:=]|import .*\b{rest[0]}\b", source,
                             re.MULTILINE), f"{_rel(page)} names {dotted}, which {_rel(module)} does not define"


# The counts of tests the pages give, as "1,262 tests not marked slow" and "58 tests marked slow" (or
# "58 slow ones", "58 slow tests"): each figure is the number before its phrase.
_COUNT_PHRASES = {"default": r"([\d,]+)\s+tests\s+not\s+marked\s+slow",
                  "slow": r"([\d,]+)\s+(?:tests\s+marked\s+slow|slow\s+ones|slow\s+tests)"}

# Collects the suite as `pytest` and `make test` run it (pyproject's addopts: -m 'not slow') and
# prints the counts: the tests that run, those deselected (the slow ones), and the test modules
# skipped while collecting (an optional package missing), which would make the counts this machine's.
_COUNTER = """
import json, sys
import pytest

class Counter:
    def __init__(self):
        self.deselected, self.skipped = [], []

    def pytest_deselected(self, items):
        self.deselected.extend(items)

    def pytest_collectreport(self, report):
        if report.skipped:
            self.skipped.append(report.nodeid)

    def pytest_collection_finish(self, session):
        def slow(items):
            return sum(1 for item in items if item.get_closest_marker("slow"))
        print("COUNTS " + json.dumps({"default": len(session.items), "slow": slow(self.deselected),
                                      "deselected": len(self.deselected), "slow_run": slow(session.items),
                                      "skipped": self.skipped}))

sys.exit(pytest.main(["--collect-only", "-qq", "-p", "no:cacheprovider"], plugins=[Counter()]))
"""


def _collected_counts() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}  # the defaults, as `make test` has them
    r = subprocess.run([sys.executable, "-c", _COUNTER], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600, check=False)
    lines = [line for line in r.stdout.splitlines() if line.startswith("COUNTS ")]
    assert r.returncode == 0 and lines, f"collecting the suite failed (exit {r.returncode}):\n{r.stdout[-3000:]}{r.stderr[-2000:]}"
    return json.loads(lines[-1][len("COUNTS "):])


def _count_figures(text: str) -> dict[str, list[int]]:
    return {kind: [int(n.replace(",", "")) for n in re.findall(phrase, text)] for kind, phrase in _COUNT_PHRASES.items()}


def test_count_figures_are_read_as_written():
    """The phrases the next test reads, on the forms the pages use."""
    assert _count_figures("runs the 1,262 tests not marked slow; `make test-all` adds the 58 tests marked\nslow") == \
        {"default": [1262], "slow": [58]}
    assert _count_figures("adds the 58 slow ones, 3 slow tests") == {"default": [], "slow": [58, 3]}


def test_test_counts_in_the_readme_and_docs_are_the_collected_ones():
    """Every count of tests in the README and docs/ (the default suite, the tests marked slow) is the
    number pytest collects now; the README and docs/training.md, "Tests", give both. When tests are
    added or removed, this fails and names the figures to update."""
    counts = _collected_counts()
    if counts["skipped"]:
        pytest.skip(f"test modules skipped while collecting (an optional package missing), so this machine's counts "
                    f"are not the suite's: {', '.join(counts['skipped'])}")
    assert counts["slow_run"] == 0 and counts["deselected"] == counts["slow"], \
        f"the default suite is no longer 'the tests not marked slow': {counts}"
    wrong = []
    for page in PAGES:
        figures = _count_figures(page.read_text())
        if page in (README, DOCS / "training.md"):
            for kind in ("default", "slow"):
                assert figures[kind], f"{_rel(page)} no longer gives the count of {kind} tests as {_COUNT_PHRASES[kind]!r}"
        wrong += [f"{_rel(page)} says {n:,} for the {kind} tests" for kind in figures for n in figures[kind]
                  if n != counts[kind]]
    assert not wrong, (f"pytest collects {counts['default']:,} tests not marked slow and {counts['slow']:,} marked "
                       f"slow, but " + "; ".join(wrong))
