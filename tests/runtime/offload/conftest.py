"""Fixtures of every offload test."""

import pytest

from fewbit_design.runtime import offload


@pytest.fixture(autouse=True)
def _release_idle_files():
    """Each test starts and ends with no idle step files (they are kept per folder, and each test has its own)."""
    offload.empty_cache()
    yield
    offload.empty_cache()
