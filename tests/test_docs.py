"""The documentation site builds with no warning (`mkdocs build --strict`, as CI builds it), into a temporary folder.

mkdocs, mkdocs-material and mkdocstrings-python come with the `docs` extra, which the `test` extra includes, so
`bash scripts/test.sh` installs them; without them the test is skipped with that reason.
"""

import importlib.util
import os
import re
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
    api = "".join(path.read_text() for path in (built / "api").rglob("index.html"))
    # every public entry point has its entry (its heading's id is its path), with a signature
    missing = [name for name in ENTRY_POINTS if f'id="{name}"' not in api]
    assert missing == [], f"public entry points missing from the API reference: {missing}"
    # no raw Sphinx role: each became a link or a code span (scripts/griffe_roles.py)
    raw = re.findall(r":(?:func|class|mod|meth|attr|data|exc|obj|const):`[^`]*`", api)
    assert raw == [], raw[:5]
    assert 'class="autorefs autorefs-internal"' in api  # roles resolved to links
    assert "language-pycon" in api or "highlight" in api  # >>> examples rendered as code blocks


#: the public entry points the API reference must hold (a new one is added here and to docs/api/)
ENTRY_POINTS = (
    "fewbit_design.runtime.conversion.convert",
    "fewbit_design.runtime.conversion.unconvert",
    "fewbit_design.runtime.planner.plan.plan_memory",
    "fewbit_design.runtime.planner.plan.MemoryPlan",
    "fewbit_design.runtime.planner.plan.load_plan",
    "fewbit_design.runtime.memory.saved_bytes",
    "fewbit_design.runtime.memory.peak",
    "fewbit_design.runtime.hf.trainer.FewBitCallback",
    "fewbit_design.runtime.hf.config_record.record",
    "fewbit_design.runtime.hf.config_record.restore",
    "fewbit_design.runtime.registry.Technique",
    "fewbit_design.runtime.fewbit.convert.convert",
    "fewbit_design.runtime.fewbit.calibrate.calibrate",
    "fewbit_design.runtime.norms.convert.convert",
    "fewbit_design.runtime.gated.convert.convert",
    "fewbit_design.runtime.attention.convert.convert",
    "fewbit_design.runtime.linear.convert.convert",
    "fewbit_design.runtime.head.convert.convert",
    "fewbit_design.runtime.blpa.fuse.convert",
    "fewbit_design.design.engine.design",
    "fewbit_design.table.Table",
)


def test_an_unknown_docstring_role_fails_the_build() -> None:
    """The Griffe extension raises on a role it does not know, so a strict build stops on it."""
    spec = importlib.util.spec_from_file_location("griffe_roles", ROOT / "scripts" / "griffe_roles.py")
    if importlib.util.find_spec("griffe") is None:
        pytest.skip("griffe is not installed (the docs extra)")
    roles = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(roles)

    class Object:
        path = "fewbit_design.x"
        is_module = True
        is_package = False
        parent = None
        module = None

    with pytest.raises(ValueError, match="unknown docstring role :ref:"):
        roles._roles("see :ref:`somewhere`", Object(), None)
    assert roles._examples("Text.\n\n>>> 1 + 1\n2\n\nMore.") == "Text.\n\n```pycon\n>>> 1 + 1\n2\n```\n\nMore."


def test_every_docs_page_is_in_the_navigation() -> None:
    """A page left out of mkdocs.yml's nav is built but unreachable; mkdocs only logs that at INFO level."""
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = sorted(path.relative_to(ROOT / "docs").as_posix() for path in (ROOT / "docs").rglob("*.md"))
    assert pages, "docs/ has no pages"
    assert [page for page in pages if f" {page}" not in nav] == []
