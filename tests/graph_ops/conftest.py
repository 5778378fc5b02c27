"""Every cast-cache test starts and ends with an empty cache."""

from cast_cache_probes import empty_cast_cache  # noqa: F401  (a fixture pytest finds by name)
import pytest


@pytest.fixture(autouse=True)
def _empty_cache(empty_cast_cache):
    yield
