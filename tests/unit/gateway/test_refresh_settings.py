"""The caches' refresh periods are settings (TESSERA_*), validated, and their defaults are the ones the
Router and ModelCatalog use when built without them."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from tessera.gateway import models
from tessera.routing import router
from tessera.settings import TesseraSettings


def test_defaults_match_the_adapters_defaults() -> None:
    settings = TesseraSettings()
    assert (settings.registry_refresh_s, settings.registry_max_age_s) == (router.REGISTRY_CACHE_S,
                                                                          router.REGISTRY_MAX_AGE_S)
    assert (settings.catalog_refresh_s, settings.catalog_max_age_s) == (models.CATALOG_REFRESH_S,
                                                                        models.CATALOG_MAX_AGE_S)


def test_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TESSERA_REGISTRY_REFRESH_S", "0.5")
    monkeypatch.setenv("TESSERA_CATALOG_MAX_AGE_S", "30")
    settings = TesseraSettings()
    assert settings.registry_refresh_s == 0.5 and settings.catalog_max_age_s == 30.0


@pytest.mark.parametrize("values", [
    {"registry_refresh_s": 0.0},
    {"catalog_refresh_s": -1.0},
    {"key_cache_ttl_s": -0.1},
    {"registry_refresh_s": 3.0},  # above its max age (2 s): every request would read inline
    {"catalog_refresh_s": 5.0, "catalog_max_age_s": 4.9},
])
def test_invalid_periods_are_refused(values: dict[str, float]) -> None:
    with pytest.raises(ValidationError):
        TesseraSettings.model_validate(values)


def test_a_max_age_equal_to_its_period_is_accepted() -> None:
    settings = TesseraSettings(registry_refresh_s=2.0, registry_max_age_s=2.0)
    assert settings.registry_max_age_s == 2.0
