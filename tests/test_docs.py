"""The documentation against the repository: every relative link and image in README.md,
benchmarks/README.md, examples/README.md and docs/ points at a file of the repository (and
at a heading of it where it names one), and no link or path leaves the repository; README's
Usage runs; the benchmarks' and the examples' lists name every script; the public
functions' calls written out in the docs name every parameter with its default."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", ROOT / "benchmarks" / "README.md",
                ROOT / "examples" / "README.md", *(ROOT / "docs").rglob("*.md")])
# the user docs: the paths they name in code spans must exist too (the notes name files of
# their day, some of them since removed: those are kept in git history)
USER_PAGES = [p for p in PAGES if "notes" not in p.relative_to(ROOT).parts]

FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
PATH_IN_CODE = re.compile(r"`((?:benchmarks|docs|examples|flashop|tests)/[\w./-]+)`")


def _prose(text: str) -> str:
    """``text`` without fenced blocks and code spans (no links are read from code)."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def slugs(text: str) -> set:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces to
    hyphens, a repeated anchor numbered -1, -2, ..."""
    seen, result = {}, set()
    for line in FENCE.sub("", text).splitlines():
        m = re.match(r"#{1,6}\s+(.*)", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        result.add(slug if n == 0 else f"{slug}-{n}")
    return result


def links(page: Path) -> list:
    return LINK.findall(_prose(page.read_text()))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve_inside_the_repository(page):
    bad = []
    for target in links(page):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if ROOT not in resolved.parents and resolved != ROOT:
            bad.append(f"{target}: outside the repository")
        elif not resolved.exists():
            bad.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in slugs(resolved.read_text()):
            bad.append(f"{target}: no heading #{anchor} in {resolved.relative_to(ROOT)}")
    assert not bad, f"{page.relative_to(ROOT)}: " + "; ".join(bad)


@pytest.mark.parametrize("page", USER_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_paths_named_in_user_docs_exist(page):
    missing = [p for p in PATH_IN_CODE.findall(page.read_text())
               if not (ROOT / p.rstrip("/.")).exists()]
    assert not missing, f"{page.relative_to(ROOT)} names missing files: {missing}"


def test_no_page_points_outside_the_repository():
    for page in PAGES:
        assert "../shared" not in page.read_text(), page.relative_to(ROOT)


def test_the_readme_keeps_the_ci_commands():
    """.ci/run runs the README's two commands, the main job and then the tests; they must
    not drift apart."""
    readme, ci = (ROOT / "README.md").read_text(), (ROOT / ".ci" / "run").read_text()
    for command in ("python -m flashop", "python -m pytest tests -n 2"):
        assert command in readme
    ci_lines = [line.strip() for line in ci.splitlines()]
    assert ci_lines.index("python -m flashop") < ci_lines.index("python -m pytest tests -n 2")


def test_slugs_follow_githubs_rule():
    assert slugs("# Score modifiers\n## Tiles and options\n## A, b's (c)\n## Tiles and options") \
        == {"score-modifiers", "tiles-and-options", "a-bs-c", "tiles-and-options-1"}


# --- what the docs say against the code -------------------------------------------------------


def _section(text: str, heading: str) -> str:
    """The part of a page from ``heading`` to the next heading of its level."""
    level = heading.split()[0]
    start = text.index(heading + "\n")
    rest = text[start + len(heading) + 1:]
    nxt = re.search(rf"^{level} ", rest, re.MULTILINE)
    return rest[:nxt.start()] if nxt else rest


@pytest.mark.compile
def test_the_readmes_usage_runs():
    """README's Usage, pasted as it is, in a fresh process without Triton's interpreter:
    on a GPU the kernels, here the CPU path."""
    import os
    import subprocess
    import sys

    code = FENCE.findall(_section((ROOT / "README.md").read_text(), "## Usage"))[0]
    code = code.strip("`").removeprefix("python\n")
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.parametrize("folder", ["benchmarks", "examples"])
def test_the_readme_lists_every_script(folder):
    """benchmarks/README.md names each script in a table row, examples/README.md in a
    heading."""
    listed = set(re.findall(r"^(?:\| |## )`([\w.]+)`", (ROOT / folder / "README.md").read_text(),
                            re.MULTILINE))
    scripts = {p.name for p in (ROOT / folder).iterdir() if p.suffix in (".py", ".sh")}
    assert scripts == listed, (scripts - listed, listed - scripts)


def _signature_text(function) -> list:
    """``name=default`` (or ``name``, without one) for each parameter of ``function``."""
    import inspect

    return [name if p.default is inspect.Parameter.empty else f"{name}={p.default!r}"
            for name, p in inspect.signature(function).parameters.items()]


@pytest.mark.parametrize("page,name", [
    ("README.md", "attention"), ("README.md", "attention_varlen"),
    ("README.md", "attention_reference"), ("docs/varlen.md", "attention_varlen"),
    ("docs/decoding.md", "attention_with_kvcache")])
def test_documented_signatures_are_the_functions(page, name):
    """Where a page writes out a public function's call, it names every parameter with its
    default."""
    import flashop

    text = (ROOT / page).read_text()
    expected = _signature_text(getattr(flashop, name))
    best = None
    for match in re.finditer(rf"\b{name}\(\s*q,", text):  # the call written out fullest
        depth, end = 0, match.end() - 1
        for end in range(text.index("(", match.start()), len(text)):
            depth += {"(": 1, ")": -1}.get(text[end], 0)
            if depth == 0:
                break
        call = " ".join(text[match.start():end + 1].replace("`", "").split())
        missing = [p for p in expected if p not in call]
        if best is None or len(missing) < len(best):
            best = missing
    assert best == [], f"{page}'s {name}(...) leaves out {best}"
