"""The documentation site builds as CI builds it, `mkdocs build --strict` (mkdocs.yml: Material theme, docs/), with
no warning: a page outside the nav, a broken link between pages or to a missing anchor is a warning there, which
--strict makes an error. The README, the repository's front page, is not part of the site (GitHub shows it): its
links are checked here against the files and headings they point to, and its length kept to a front page's.

The commands of the pages are run by tests/test_readme.py; this file only builds and links. A few seconds.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

from support.helpers import BIN, REPO
from support.readme_run import pages

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def build(config, site) -> subprocess.CompletedProcess:
    """`mkdocs build --strict` of `config` into `site` (Material's end-of-life banner switched off)."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    cmd = [str(BIN / "mkdocs"), "build", "--strict", "--config-file", str(config), "--site-dir", str(site)]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)


def test_the_site_builds_strict_with_no_warning(tmp_path):
    proc = build(REPO / "mkdocs.yml", tmp_path / "site")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "WARNING" not in output, output[-4000:]
    for page in pages()[1:]:  # every page of the nav became a page of the site
        name = page.removeprefix("docs/").removesuffix(".md")
        built = tmp_path / "site" / ("index.html" if name == "index" else f"{name}/index.html")
        assert built.exists(), page
    assert sorted(pages()[1:]) == sorted(f"docs/{p.name}" for p in (REPO / "docs").glob("*.md"))


def test_strict_fails_on_a_broken_link_or_anchor(tmp_path):
    """The check can fail: a copy of the site with a link to a missing page and one to a missing heading."""
    shutil.copytree(REPO / "docs", tmp_path / "docs")
    shutil.copy(REPO / "mkdocs.yml", tmp_path / "mkdocs.yml")
    with open(tmp_path / "docs" / "index.md", "a") as fh:
        fh.write("\n[gone](no-such-page.md) and [nowhere](usage.md#no-such-heading)\n")
    proc = build(tmp_path / "mkdocs.yml", tmp_path / "site")
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "no-such-page.md" in output and "no-such-heading" in output, output[-4000:]


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading: lower case, punctuation but hyphens dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def test_the_readme_is_a_front_page_whose_links_resolve():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 200, "README.md is the front page: at most ~200 lines, the rest in docs/"
    targets = [t for t in LINK.findall(readme) if not t.startswith(("http://", "https://", "mailto:"))]
    assert targets, "the front page links to the documentation"
    broken = []
    for target in targets:
        path, _, anchor = target.partition("#")
        file = REPO / path
        if not file.exists():
            broken.append(target)
        elif anchor and file.is_file():
            headings = re.findall(r"^#{1,6} (.+)$", file.read_text(), re.M)
            if anchor not in {github_anchor(h) for h in headings}:
                broken.append(target)
    assert not broken, f"README.md links to what is not there: {broken}"
    linked = {t.partition("#")[0] for t in targets}
    assert set(pages()[1:]) <= linked | {"docs/index.md"}, set(pages()[1:]) - linked
