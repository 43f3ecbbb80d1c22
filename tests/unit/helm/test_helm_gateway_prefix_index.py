"""The gateway's prefix index in the chart (docs/routing.md "The gateway's local index"): each worker's own
index by default, its cap handed to the workers, the Redis lookup a value away, and a mistyped choice
refused at install."""

from __future__ import annotations

from typing import Any

import helm_python
import pytest

from tessera.settings import TesseraSettings
from tests.support.chart import env_values, find, render

JSON = dict[str, Any]


def _env(values: JSON | None = None) -> dict[str, str]:
    return env_values(find(render(values), "Deployment", "-gateway")["spec"]["template"]["spec"]["containers"][0])


def test_the_gateway_routes_from_its_local_index_by_default_with_the_settings_cap() -> None:
    env = _env()
    assert env["TESSERA_PREFIX_INDEX"] == "local" == TesseraSettings().prefix_index
    assert int(env["TESSERA_LOCAL_INDEX_MAX_BLOCKS"]) == TesseraSettings().local_index_max_blocks


def test_the_redis_lookup_and_another_cap_are_values_away() -> None:
    env = _env({"gateway": {"prefixIndex": "redis", "localIndexMaxBlocks": 5_000_000}})
    assert env["TESSERA_PREFIX_INDEX"] == "redis"
    assert env["TESSERA_LOCAL_INDEX_MAX_BLOCKS"] == "5000000"  # not 5e+06: the workers parse an int


@pytest.mark.parametrize("values", [{"prefixIndex": "lcoal"}, {"localIndexMaxBlocks": 0}])
def test_a_mistyped_index_choice_or_cap_is_refused_at_install(values: JSON) -> None:
    with pytest.raises(helm_python.HelmValuesError):
        render({"gateway": values})
