"""Usage and budget periods: pure functions of a UTC timestamp.

A period is ``hour``, ``day`` or ``month`` (UTC). Its id names the Redis keys of that period
(``2025-03``, ``2025-03-14``, ``2025-03-14T09``); the seconds until it ends are the budget key's TTL, so a
budget resets by itself when its period ends.
"""

from __future__ import annotations

import calendar
from datetime import UTC, datetime

PERIODS = ("hour", "day", "month")

# How long usage of a finished period stays queryable.
USAGE_RETENTION_S: dict[str, int] = {"hour": 31 * 86400, "day": 400 * 86400, "month": 400 * 86400}


def check_period(period: str) -> str:
    if period not in PERIODS:
        raise ValueError(f"unknown period {period!r}: use one of {', '.join(PERIODS)}")
    return period


def period_window(period: str, now: datetime) -> tuple[str, int]:
    """The id of the period containing ``now`` and the whole seconds until it ends, rounded up (>= 1)."""
    check_period(period)
    now = now.astimezone(UTC) if now.tzinfo is not None else now.replace(tzinfo=UTC)
    if period == "hour":
        start = now.replace(minute=0, second=0, microsecond=0)
        length_s = 3600
        period_id = start.strftime("%Y-%m-%dT%H")
    elif period == "day":
        start = now.replace(hour=0, minute=0, second=0, microsecond=0)
        length_s = 86400
        period_id = start.strftime("%Y-%m-%d")
    else:
        start = now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
        length_s = calendar.monthrange(now.year, now.month)[1] * 86400
        period_id = start.strftime("%Y-%m")
    remaining = start.timestamp() + length_s - now.timestamp()
    return period_id, max(1, int(-(-remaining // 1)))
