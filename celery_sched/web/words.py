"""Schedules and lag put in words and drawn as SVG, for the console's pages."""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from typing import Any

from markupsafe import Markup, escape

_DAYS = {
    "1-5": "on weekdays",
    "mon-fri": "on weekdays",
    "0,6": "on weekends",
    "6,0": "on weekends",
    "sat,sun": "on weekends",
    "*": "",
}


def _plural(count: float, unit: str) -> str:
    text = f"{count:g}"
    return f"every {unit}" if count == 1 else f"every {text} {unit}s"


def schedule_words(kind: str, spec: Mapping[str, Any], timezone: str) -> str:
    """``"at 07:00 on weekdays, Europe/Paris"``: a schedule as people say it;
    a cron pattern too irregular to say stays a pattern."""
    if kind == "interval":
        seconds = float(spec.get("seconds", 0))
        for size, unit in ((86400, "day"), (3600, "hour"), (60, "minute")):
            if seconds >= size and seconds % size == 0:
                return _plural(seconds / size, unit)
        return _plural(seconds, "second")
    if kind == "crontab":
        minute = str(spec.get("minute", "*"))
        hour = str(spec.get("hour", "*"))
        dow = str(spec.get("day_of_week", "*")).lower()
        dom = str(spec.get("day_of_month", "*"))
        month = str(spec.get("month_of_year", "*"))
        if minute.isdigit() and hour.isdigit() and dom == "*" and month == "*" and dow in _DAYS:
            days = _DAYS[dow] or "every day"
            return f"at {int(hour):02d}:{int(minute):02d} {days}, {timezone}"
        if minute.isdigit() and hour == "*" and dom == "*" and month == "*" and dow == "*":
            return f"at minute {int(minute)} of every hour, {timezone}"
        if minute.startswith("*/") and hour == dom == month == dow == "*":
            return f"every {minute[2:]} minutes, {timezone}"
        return f"cron {minute} {hour} {dom} {month} {dow}, {timezone}"
    if kind == "clocked":
        return f"once at {spec.get('at')}"
    if kind == "solar":
        return f"at {spec.get('event')} ({spec.get('lat')}, {spec.get('lon')})"
    return f"{kind} schedule"


def cron_text(spec: Mapping[str, Any]) -> str:
    """The five cron fields of a crontab spec, as the edit form shows them."""
    return " ".join(
        str(spec.get(field, "*"))
        for field in ("minute", "hour", "day_of_month", "month_of_year", "day_of_week")
    )


def bar_chart(
    points: Sequence[tuple[dt.datetime, float]],
    *,
    width: int = 600,
    height: int = 120,
    unit: str = "",
    title: str = "",
) -> Markup:
    """An inline SVG bar chart of ``points`` (time, value), readable without
    JavaScript; each bar's <title> gives its exact value on hover."""
    parts = [
        f'<svg class="chart" role="img" viewBox="0 0 {width} {height + 20}" '
        f'width="{width}" height="{height + 20}">',
        f"<title>{escape(title)}</title>",
        f'<line x1="0" y1="{height}" x2="{width}" y2="{height}" stroke="#999"/>',
    ]
    top = max((value for _, value in points), default=0.0)
    if not points or top <= 0:
        parts.append(f'<text x="8" y="{height // 2}" fill="#666">no data</text>')
    else:
        step = width / len(points)
        for index, (at, value) in enumerate(points):
            bar = value / top * (height - 10)
            parts.append(
                f'<rect x="{index * step + 1:.1f}" y="{height - bar:.1f}" '
                f'width="{max(step - 2, 1):.1f}" height="{bar:.1f}" fill="#3b6ea5">'
                f"<title>{escape(at.strftime('%H:%M'))}: {value:g}{escape(unit)}</title></rect>"
            )
        parts.append(f'<text x="2" y="10" font-size="10" fill="#333">{top:g}{escape(unit)}</text>')
        first, last = points[0][0], points[-1][0]
        parts.append(
            f'<text x="2" y="{height + 14}" font-size="10" fill="#333">'
            f"{escape(first.strftime('%H:%M'))}</text>"
            f'<text x="{width - 2}" y="{height + 14}" font-size="10" fill="#333" '
            f'text-anchor="end">{escape(last.strftime("%H:%M"))} UTC</text>'
        )
    parts.append("</svg>")
    return Markup("".join(parts))  # noqa: S704  (every interpolated text is escaped above)
