"""The documentation site builds with no warning (`mkdocs build --strict`, as CI builds it), into a temporary folder.

mkdocs, mkdocs-material and mkdocstrings-python come with the `docs` extra, which the `test` extra includes, so
`bash scripts/test.sh` installs them; without them the test is skipped with that reason.
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_docs_build_strict_without_warnings(tmp_path: Path) -> None:
    missing = [name for name in ("mkdocs", "material", "mkdocstrings_handlers") if not importlib.util.find_spec(name)]
    if missing:
        pytest.skip(f"the docs extra is not installed ({', '.join(missing)} missing): pip install -e '.[docs]'")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-4000:]
    assert "WARNING" not in log, log[-4000:]
    built = tmp_path / "site"
    for page in ("index.html", "getting-started/index.html", "techniques/planner/index.html", "api/runtime/index.html"):
        assert (built / page).is_file(), page
    # the API reference is generated from the docstrings, not empty
    assert "plan_memory" in (built / "api" / "techniques" / "index.html").read_text()


def test_every_docs_page_is_in_the_navigation() -> None:
    """A page left out of mkdocs.yml's nav is built but unreachable; mkdocs only logs that at INFO level."""
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = sorted(path.relative_to(ROOT / "docs").as_posix() for path in (ROOT / "docs").rglob("*.md"))
    assert pages, "docs/ has no pages"
    assert [page for page in pages if f" {page}" not in nav] == []
