"""The README and the documentation site stay true: the profile reference is generated from the models, every command
is listed, the README is a short front door whose links resolve, and the site builds with `mkdocs build --strict`
(a broken link, an unknown anchor or a page missing from the nav fails)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from specops.cli import COMMANDS
from specops.config.docs import END, PAGE, START, profile_reference
from specops.config.profile import Profile

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"


def test_profile_reference_in_the_docs_is_current():
    text = (ROOT / PAGE).read_text(encoding="utf-8")
    section = text[text.index(START) + len(START) : text.index(END)].strip()
    assert section == profile_reference().strip(), "run: python -m specops.config.docs --write"


def test_profile_reference_lists_every_field():
    """Every field, including those of optional sections (`deploy.pools.plain.autoscale`) and of list entries
    (`routing.twins[].url`, `fallback.chain[].method`)."""
    ref = profile_reference()

    def models_in(annotation, suffix=""):
        if isinstance(annotation, type) and hasattr(annotation, "model_fields"):
            return [(annotation, suffix)]
        suffix = "[]" if typing.get_origin(annotation) in (list, tuple) else suffix
        return [found for arg in typing.get_args(annotation) for found in models_in(arg, suffix)]

    def walk(model, prefix=""):
        for name, field in model.model_fields.items():
            inner = models_in(field.annotation)
            if not (isinstance(field.annotation, type) and inner):
                yield prefix + name  # a section always there has no row of its own
            for sub, suffix in inner:
                yield from walk(sub, f"{prefix}{name}{suffix}.")

    fields = set(walk(Profile))
    assert {"deploy.pools.plain.autoscale.max_replicas", "routing.twins[].url", "fallback.chain[].method"} <= fields
    missing = sorted(f for f in fields if f"`{f}`" not in ref)
    assert not missing


def test_every_command_is_in_the_cli_reference():
    text = (DOCS / "reference" / "cli.md").read_text(encoding="utf-8")
    for name in COMMANDS:
        assert f"`specops {name}" in text or (name in ("setup",) and "specops engines" in text), name


def test_readme_opens_with_the_two_commands_ci_uses():
    text = README.read_text(encoding="utf-8")
    first_block = text[text.index("```bash") : text.index("```", text.index("```bash") + 3)]
    assert "scripts/demo" in first_block and "scripts/test" in first_block
    ci = (README.parent / ".ci" / "run").read_text()
    assert "scripts/test" in ci


def test_readme_is_a_short_front_door_whose_links_resolve():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 250
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    local = [t.split("#")[0] for t in targets if not t.startswith(("http://", "https://", "#"))]
    assert any(t.startswith("docs/") for t in local)
    missing = [t for t in local if t and not (ROOT / t).exists()]
    assert not missing, missing


def _mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess:
    if shutil.which("mkdocs", path=str(Path(sys.executable).parent)) is None:
        pytest.skip("mkdocs is not installed (pip install -e '.[test]')")
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
        capture_output=True,
        text=True,
        timeout=240,
        env={"PATH": "/usr/bin:/bin", "NO_MKDOCS_2_WARNING": "1"},
    )


def test_the_docs_site_builds_strictly(tmp_path):
    done = _mkdocs_build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "reference" / "profile" / "index.html").is_file()
    assert "speculative.method" in (tmp_path / "site" / "reference" / "profile" / "index.html").read_text()
    results = (tmp_path / "site" / "results" / "index.html").read_text()
    second_heading = [
        line for line in (ROOT / "benchmarks" / "RESULTS.md").read_text().splitlines() if line[:3] == "## "
    ]
    assert "--8<--" not in results and second_heading[0][3:].split(":")[0] in results, "RESULTS.md not included"


@pytest.mark.parametrize(
    "breakage",
    ["a link to a missing page", "an anchor no page has", "a page left out of the nav"],
)
def test_a_broken_docs_site_fails_the_build(tmp_path, breakage):
    """The strict build above could pass by checking nothing (`mkdocs build -q --strict` does: quiet drops the
    warnings strict counts): the same site with one defect must fail."""
    shutil.copytree(DOCS, tmp_path / "docs")
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    index = tmp_path / "docs" / "index.md"
    if breakage == "a link to a missing page":
        index.write_text(index.read_text() + "\nSee [the missing page](no-such-page.md).\n")
    elif breakage == "an anchor no page has":
        index.write_text(index.read_text() + "\nSee [supervision](supervision.md#no-such-section).\n")
    else:
        (tmp_path / "docs" / "orphan.md").write_text("# Orphan\n\nA page no nav entry names.\n")
    done = _mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert done.returncode != 0, breakage


def test_the_generator_refuses_a_file_without_the_markers(tmp_path):
    """`--write README.md` was the old habit: the README no longer holds the reference, so it is refused, not
    a traceback (and the file is left as it was)."""
    readme = tmp_path / "README.md"
    readme.write_text("# a README without the reference\n")
    done = subprocess.run(
        [sys.executable, "-m", "specops.config.docs", "--write", str(readme)], capture_output=True, text=True
    )
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "docs/reference/profile.md" in done.stderr
    assert readme.read_text() == "# a README without the reference\n"
