"""Server-side SVG charts: no JavaScript library, no CDN, works air-gapped."""

from __future__ import annotations

from collections.abc import Sequence
from html import escape

__all__ = ["line_chart_svg"]

WIDTH, HEIGHT, PAD = 640, 220, 36


def line_chart_svg(
    points: Sequence[tuple[float, float]],
    *,
    title: str,
    y_max: float = 1.0,
    y_label: str = "hit rate",
) -> str:
    """A line chart of ``(t, y)`` points with y in ``[0, y_max]``.

    >>> "<polyline" in line_chart_svg([(0, 0.5), (10, 1.0)], title="x")
    True
    """
    inner_w, inner_h = WIDTH - 2 * PAD, HEIGHT - 2 * PAD
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {HEIGHT}" '
        f'role="img" aria-label="{escape(title)}" class="chart">',
        f'<text x="{PAD}" y="18" font-size="13" font-family="sans-serif">{escape(title)}</text>',
        f'<rect x="{PAD}" y="{PAD}" width="{inner_w}" height="{inner_h}" fill="none" stroke="#ccc"/>',
    ]
    for frac in (0.0, 0.5, 1.0):
        y = PAD + inner_h * (1 - frac)
        parts.append(
            f'<text x="4" y="{y + 4:.0f}" font-size="10" font-family="sans-serif">'
            f"{frac * y_max:.0%}</text>"
            if y_label == "hit rate"
            else f'<text x="4" y="{y + 4:.0f}" font-size="10">{frac * y_max:.0f}</text>'
        )
    if not points:
        parts.append(
            f'<text x="{WIDTH / 2 - 40}" y="{HEIGHT / 2}" font-size="12" '
            'font-family="sans-serif">no data yet</text></svg>'
        )
        return "".join(parts)
    t0, t1 = points[0][0], points[-1][0]
    span = max(t1 - t0, 1.0)
    coords = " ".join(
        f"{PAD + inner_w * (t - t0) / span:.1f},"
        f"{PAD + inner_h * (1 - min(max(y / y_max, 0), 1)):.1f}"
        for t, y in points
    )
    parts.append(
        f'<polyline points="{coords}" fill="none" stroke="#2563eb" stroke-width="2"/>'
    )
    last_t, last_y = points[-1]
    parts.append(
        f'<circle cx="{PAD + inner_w * (last_t - t0) / span:.1f}" '
        f'cy="{PAD + inner_h * (1 - min(max(last_y / y_max, 0), 1)):.1f}" r="3" fill="#2563eb"/>'
    )
    for x, label in ((PAD, f"-{span / 60:.0f} min"), (WIDTH - PAD - 20, "now")):
        parts.append(
            f'<text x="{x}" y="{HEIGHT - 12}" font-size="10" font-family="sans-serif">'
            f"{label}</text>"
        )
    parts.append("</svg>")
    return "".join(parts)
