"""The documentation: the site builds in strict mode, and the generated reference pages are current.

The Sphinx build runs in CI (``.ci/run`` installs the ``docs`` extra through ``dev`` and sets
``AMPROBE_REQUIRE_DOCS=1``, so a missing Sphinx fails there instead of skipping).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"

_spec = importlib.util.spec_from_file_location("gen_reference", DOCS / "gen_reference.py")
assert _spec is not None and _spec.loader is not None
gen_reference = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gen_reference)  # docs/gen_reference.py is a script, not a package module

_DOC_TOOLS = ("sphinx", "myst_parser", "furo")


def _docs_tools_missing() -> str | None:
    missing = [name for name in _DOC_TOOLS if importlib.util.find_spec(name) is None]
    if not missing:
        return None
    if os.environ.get("AMPROBE_REQUIRE_DOCS"):
        pytest.fail(f"AMPROBE_REQUIRE_DOCS is set but {', '.join(missing)} cannot be imported")
    return f"{', '.join(missing)} not installed: pip install -e '.[docs]'"


def test_docs_build_strict(tmp_path: Path) -> None:
    """Every page builds with warnings as errors (-W) and nitpicky references (-n): a broken
    link to a page, a heading anchor or an image fails here."""
    missing = _docs_tools_missing()
    if missing:
        pytest.skip(missing)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "sphinx",
            "-W",
            "--keep-going",
            "-n",
            "-q",
            "-b",
            "html",
            "-d",
            str(tmp_path / "doctrees"),
            str(DOCS),
            str(tmp_path / "html"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert proc.returncode == 0, f"the docs build warned or failed:\n{proc.stderr}{proc.stdout}"
    assert (tmp_path / "html" / "reference" / "findings.html").exists()


def test_each_page_has_one_title() -> None:
    """One top-level heading per page: a second one would be a second page in the navigation."""
    for page in DOCS.rglob("*.md"):
        if "_build" in page.parts:
            continue
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
        titles = re.findall(r"^# ", text, flags=re.MULTILINE)
        assert len(titles) == 1, f"{page.relative_to(REPO)} has {len(titles)} top-level headings"


def test_reference_pages_are_generated_from_the_code() -> None:
    """docs/reference/*.md equal what the generator writes from the registry, fields and Config."""
    stale = gen_reference.stale_pages()
    assert not stale, (
        f"docs/reference/{', '.join(stale)} differ from the code: run "
        f"`{gen_reference.COMMAND}` and commit the result"
    )


def test_reference_pages_hold_every_rule_column_and_key() -> None:
    """The generator leaves nothing out: each rule ID, steps column and Config key appears."""
    import dataclasses

    import amprobe.rules  # noqa: F401
    from amprobe.config import Config
    from amprobe.rules.engine import REGISTRY
    from amprobe.store.fields import STEP_FIELDS
    from amprobe.store.schema import TABLES

    findings = gen_reference.render_findings()
    for rule_id, spec in REGISTRY.items():
        assert f"### {rule_id} {spec.name}" in findings
        for name in spec.thresholds:
            assert f"`{name}` = " in findings
    recorded = gen_reference.render_recorded()
    for field in STEP_FIELDS:
        assert f"| `{field.name}` | {field.type} | {field.units or '-'} |" in recorded
    for table, columns in TABLES.items():
        assert f"## {table}\n" in recorded
        assert all(f"| `{column}` |" in recorded for column in columns)
    config = gen_reference.render_config()
    for field in dataclasses.fields(Config):
        assert f"\n## {field.name}\n" in config


def test_hand_written_pages_link_to_the_reference_instead_of_repeating_it() -> None:
    findings = (DOCS / "findings.md").read_text()
    assert "reference/findings.md" in findings
    # the old hand-written table listed every rule in a row of its own
    assert not re.search(r"^\| AMP-N0\d \|", findings, flags=re.MULTILINE)
    assert "reference/configuration.md" in (DOCS / "configuration.md").read_text()
    assert "reference/recorded.md" in (DOCS / "recorded.md").read_text()


# -- README: the page a user reads first ------------------------------------------------------


def test_readme_is_short_and_links_every_docs_page() -> None:
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) < 250
    links = set(re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme))
    local = {link for link in links if not re.match(r"[a-z]+://", link)}
    assert [link for link in local if not (REPO / link).exists()] == [], "broken links in README"
    pages = {
        str(p.relative_to(REPO))
        for p in DOCS.rglob("*.md")
        if "_build" not in p.parts and p.name != "index.md"
    }
    assert pages - local == set(), "docs pages README does not link"


def test_readme_quick_start_commands_are_what_ci_runs() -> None:
    """The two quick-start commands are kept verbatim; `.ci/run` ends in the same test command."""
    readme = (REPO / "README.md").read_text()
    install = (
        'python -c "import torch" 2>/dev/null || pip install torch==2.13.0; pip install -e ".[dev]"'
    )
    assert f"{install} && amprobe demo\n" in readme
    assert f"{install} && python -m pytest\n" in readme
    ci = (REPO / ".ci" / "run").read_text()
    assert 'pip install --quiet -e ".[dev]"' in ci
    assert ci.rstrip().endswith('"$PY" -m pytest')
