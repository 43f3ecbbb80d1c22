"""Readable tick labels: plain numbers (``0.05``, ``20``, ``1,500``), never ``5.3×10⁻²``.

matplotlib labels log axes with powers of ten and switches linear axes to scientific notation or an
offset for large ranges. Latencies are plotted in milliseconds, where plain numbers read at a glance.
matplotlib is imported inside ``use_plain_ticks`` only (it takes a second to import).
"""

from __future__ import annotations

import math
from typing import Any

SIGNIFICANT_DIGITS = 3
MS_PER_S = 1000.0
# The minor ticks labelled on a log axis spanning more than a decade: 2x and 5x a power of ten.
MINOR_LABELS_WIDE = (2.0, 5.0)


def plain_number(value: float) -> str:
    """``value`` with up to three significant digits, thousands separated, no exponent, no trailing zeros."""
    if value == 0 or not math.isfinite(value):
        return "0" if value == 0 else str(value)
    decimals = max(0, SIGNIFICANT_DIGITS - 1 - math.floor(math.log10(abs(value))))
    text = f"{value:,.{decimals}f}"
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return text


def use_plain_ticks(axis: Any, log_scale: bool) -> None:
    """Label ``axis`` (a matplotlib ``XAxis``/``YAxis``) with plain numbers, major and minor ticks alike."""
    from matplotlib.ticker import FuncFormatter, LogFormatter, ScalarFormatter

    class PlainLogFormatter(LogFormatter):  # type: ignore[misc]
        """LogFormatter's choice of which ticks get a label (all of them over a decade or less, fewer over
        wider ranges), with plain numbers as the labels."""

        def __call__(self, x: float, pos: int | None = None) -> str:
            if not super().__call__(x, pos) or x <= 0:
                return ""
            # NOTE: over more than a decade, LogFormatter still labels every minor tick between two powers
            # of ten (20,000 30,000 40,000 ...), and wide labels run into each other: keep the 2s and 5s.
            low, high = sorted(self.axis.get_view_interval()) if self.axis is not None else (x, x)
            if low > 0 and math.log10(high / low) > 1.0:
                mantissa = x / 10 ** math.floor(math.log10(x) + 1e-9)
                if not any(math.isclose(mantissa, keep, rel_tol=1e-6) for keep in MINOR_LABELS_WIDE):
                    return ""
            return plain_number(x)

    if log_scale:
        axis.set_major_formatter(FuncFormatter(lambda x, _pos: plain_number(x)))
        axis.set_minor_formatter(PlainLogFormatter(labelOnlyBase=False))
        return
    # NOTE: on a linear axis the labels need as many decimals as the tick spacing (20000.5, 20001.0),
    # which ScalarFormatter works out; only its offset and scientific notation are turned off.
    linear = ScalarFormatter(useOffset=False)
    linear.set_scientific(False)
    axis.set_major_formatter(linear)
