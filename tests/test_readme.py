"""The README stays short and true to the checkout: at most 160 lines; its two commands are the
launch scripts and `.ci/run` runs its test command; every path and link it names exists (anchors
into docs/results.md included); its map of docs/ lists every page there."""
import os
import re

from tests import ROOT

README = open(os.path.join(ROOT, "README.md")).read()


def _slug(heading: str) -> str:
    """GitHub's anchor of a markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_readme_fits_on_two_screens():
    assert len(README.splitlines()) <= 160


def test_the_two_commands_and_ci():
    commands = [l.strip().split("#")[0].strip() for l in README.splitlines() if l.startswith("    ./")]
    assert commands == ["./launch/run_main.sh", "./launch/run_tests.sh"]
    ci = open(os.path.join(ROOT, ".ci", "run")).read()
    assert re.search(r"^exec \./launch/run_tests\.sh\s*$", ci, re.M), ci  # the README's test command, as written


def test_every_path_and_link_exists():
    links = re.findall(r"\]\(([^)]+)\)", README)
    paths = re.findall(r"`((?:docs|launch|bench|examples|tests|patches|megatron_dmuon|algorithms|planning)/[^`\s]*)`",
                       README)
    assert links and paths
    for target in links + paths:
        path, _, anchor = target.partition("#")
        path = path.rstrip("/")
        candidates = [os.path.join(ROOT, path), os.path.join(ROOT, "megatron_dmuon", path)]
        assert any(os.path.exists(c) for c in candidates), target
        if anchor:
            text = open(os.path.join(ROOT, path)).read()
            anchors = {_slug(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}
            assert anchor in anchors, (target, sorted(anchors))


def test_the_map_lists_every_docs_page():
    pages = sorted(f for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md"))
    mapped = README[README.index("## Map of docs/"):]
    assert [p for p in pages if f"(docs/{p})" not in mapped] == []
