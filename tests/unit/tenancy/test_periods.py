"""Budget and usage periods: ids and the seconds until each period ends (UTC)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest

from tessera.tenancy.periods import PERIODS, USAGE_RETENTION_S, check_period, period_window


def at(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)  # type: ignore[misc]


def test_ids_name_the_period() -> None:
    now = at(2025, 3, 14, 9, 26, 53)
    assert period_window("hour", now)[0] == "2025-03-14T09"
    assert period_window("day", now)[0] == "2025-03-14"
    assert period_window("month", now)[0] == "2025-03"


def test_ttl_is_the_time_left_in_the_period() -> None:
    now = at(2025, 3, 14, 9, 26, 53)
    assert period_window("hour", now)[1] == 33 * 60 + 7
    assert period_window("day", now)[1] == 14 * 3600 + 33 * 60 + 7
    assert period_window("month", now)[1] == 17 * 86400 + 14 * 3600 + 33 * 60 + 7


def test_ttl_rounds_up_and_is_at_least_one_second() -> None:
    last = at(2025, 3, 14, 9, 59, 59) + timedelta(microseconds=999_999)
    assert period_window("hour", last) == ("2025-03-14T09", 1)
    assert period_window("hour", at(2025, 3, 14, 9, 59, 59) + timedelta(microseconds=1))[1] == 1
    assert period_window("hour", at(2025, 3, 14, 10, 0, 0)) == ("2025-03-14T10", 3600)


@pytest.mark.parametrize("year, month, days", [(2024, 2, 29), (2025, 2, 28), (2025, 4, 30), (2025, 12, 31)])
def test_month_length_follows_the_calendar(year: int, month: int, days: int) -> None:
    assert period_window("month", at(year, month, 1))[1] == days * 86400


def test_december_rolls_into_the_next_year() -> None:
    assert period_window("month", at(2025, 12, 31, 23, 59, 59)) == ("2025-12", 1)
    assert period_window("day", at(2025, 12, 31, 23, 0, 0)) == ("2025-12-31", 3600)


def test_other_time_zones_are_converted_to_utc() -> None:
    # 01:30 in UTC+2 is 23:30 UTC of the previous day.
    local = datetime(2025, 3, 15, 1, 30, tzinfo=timezone(timedelta(hours=2)))
    assert period_window("day", local) == ("2025-03-14", 1800)


def test_naive_times_are_read_as_utc() -> None:
    assert period_window("hour", datetime(2025, 3, 14, 9, 30)) == ("2025-03-14T09", 1800)


def test_unknown_period_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="hour, day, month"):
        period_window("week", at(2025, 1, 1))
    with pytest.raises(ValueError):
        check_period("")


def test_usage_is_retained_for_every_period() -> None:
    assert set(USAGE_RETENTION_S) == set(PERIODS)
    assert all(USAGE_RETENTION_S[p] > 86400 for p in PERIODS)
