"""Server-rendered SVG charts for the usage page (no JavaScript, nothing fetched).

Each chart is plain SVG with a ``<title>`` per series so a browser shows values on
hover and tests can read them; colours come from a fixed palette, one per team.
"""

from __future__ import annotations

import html
import time

PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"]
W, H, PAD_L, PAD_B, PAD_T, PAD_R = 720, 230, 44, 28, 24, 130


def _e(s) -> str:
    return html.escape(str(s), quote=True)


def _frame(
    chart_id: str, title: str, y_max: float, t0: float, t1: float, body: list[str], legend: list[tuple[str, str]], y_label: str
) -> str:
    plot_w, plot_h = W - PAD_L - PAD_R, H - PAD_T - PAD_B
    parts = [
        f'<svg id="{_e(chart_id)}" class="gpuhub-chart" role="img" aria-label="{_e(title)}" '
        f'viewBox="0 0 {W} {H}" width="100%" style="max-width:{W}px" xmlns="http://www.w3.org/2000/svg">',
        f"<title>{_e(title)}</title>",
        f'<rect x="{PAD_L}" y="{PAD_T}" width="{plot_w}" height="{plot_h}" fill="#fafafa" stroke="#ccc"/>',
    ]
    for i in range(5):
        v = y_max * i / 4
        y = PAD_T + plot_h - plot_h * i / 4
        parts.append(
            f'<line x1="{PAD_L}" x2="{PAD_L + plot_w}" y1="{y:.1f}" y2="{y:.1f}" stroke="#eee"/>'
            f'<text x="{PAD_L - 4}" y="{y + 4:.1f}" font-size="10" text-anchor="end">{v:.3g}</text>'
        )
    for i in range(5):
        t = t0 + (t1 - t0) * i / 4
        x = PAD_L + plot_w * i / 4
        label = time.strftime("%m-%d %H:%M", time.gmtime(t))
        parts.append(f'<text x="{x:.1f}" y="{H - 8}" font-size="10" text-anchor="middle">{label}</text>')
    parts.append(f'<text x="4" y="11" font-size="10" font-weight="bold">{_e(title)} ({_e(y_label)})</text>')
    parts.extend(body)
    if not body or all('class="gpuhub-' not in b for b in body):
        parts.append(
            f'<text class="gpuhub-nodata" x="{PAD_L + plot_w / 2}" y="{PAD_T + plot_h / 2}" font-size="12" '
            f'text-anchor="middle" fill="#777">nothing in this period</text>'
        )
    for i, (name, colour) in enumerate(legend):
        y = PAD_T + 12 + i * 14
        parts.append(
            f'<rect x="{W - PAD_R + 8}" y="{y - 8}" width="10" height="10" fill="{colour}"/>'
            f'<text x="{W - PAD_R + 22}" y="{y + 1}" font-size="11">{_e(name)}</text>'
        )
    parts.append("</svg>")
    return "".join(parts)


def step_chart(
    chart_id: str,
    title: str,
    series: dict[str, list[tuple[float, float]]],
    t0: float,
    t1: float,
    y_label: str,
    limits: dict[str, float] | None = None,
) -> str:
    """Step lines per name (value holds until the next point); dashed ``limits`` (quota) lines."""
    limits = limits or {}
    y_max = max([1.0] + [v for pts in series.values() for _, v in pts] + list(limits.values()))
    plot_w, plot_h = W - PAD_L - PAD_R, H - PAD_T - PAD_B
    span = max(1.0, t1 - t0)
    x = lambda t: PAD_L + plot_w * (min(max(t, t0), t1) - t0) / span  # noqa: E731
    y = lambda v: PAD_T + plot_h - plot_h * v / y_max  # noqa: E731
    body, legend = [], []
    names = sorted(set(series) | set(limits))
    for i, name in enumerate(names):
        colour = PALETTE[i % len(PALETTE)]
        legend.append((name, colour))
        pts = sorted(series.get(name, []))
        if pts:
            d, last = [], 0.0
            d.append(f"M{x(t0):.1f},{y(last):.1f}")
            for t, v in pts:
                d.append(f"L{x(t):.1f},{y(last):.1f}L{x(t):.1f},{y(v):.1f}")
                last = v
            d.append(f"L{x(t1):.1f},{y(last):.1f}")
            body.append(
                f'<path class="gpuhub-series" data-name="{_e(name)}" d="{"".join(d)}" fill="none" '
                f'stroke="{colour}" stroke-width="2"><title>{_e(name)}: now {last:g}</title></path>'
            )
        if name in limits:
            body.append(
                f'<line class="gpuhub-limit" data-name="{_e(name)}" x1="{PAD_L}" x2="{PAD_L + plot_w}" '
                f'y1="{y(limits[name]):.1f}" y2="{y(limits[name]):.1f}" stroke="{colour}" stroke-dasharray="5,4">'
                f"<title>{_e(name)} quota {limits[name]:g}</title></line>"
            )
    return _frame(chart_id, title, y_max, t0, t1, body, legend, y_label)


def bar_chart(chart_id: str, title: str, groups: dict[str, dict[str, float]], parts: list[tuple[str, str]], y_label: str) -> str:
    """Grouped bars: per group name, one bar per part (key, label)."""
    top = max([0.0] + [v for g in groups.values() for v in g.values()])
    y_max = top * 1.1 if top > 0 else 1.0  # GPU-hours can be small: scale to the data
    plot_w, plot_h = W - PAD_L - PAD_R, H - PAD_T - PAD_B
    body = []
    n = max(1, len(groups))
    slot = plot_w / n
    bw = slot * 0.8 / max(1, len(parts))
    for gi, (gname, values) in enumerate(sorted(groups.items())):
        for pi, (key, label) in enumerate(parts):
            v = values.get(key, 0.0)
            h = plot_h * v / y_max
            bx = PAD_L + gi * slot + slot * 0.1 + pi * bw
            body.append(
                f'<rect class="gpuhub-bar" data-group="{_e(gname)}" data-part="{_e(key)}" data-value="{v:.4f}" '
                f'x="{bx:.1f}" y="{PAD_T + plot_h - h:.1f}" width="{bw:.1f}" height="{h:.1f}" '
                f'fill="{PALETTE[pi % len(PALETTE)]}"><title>{_e(gname)} {_e(label)}: {v:.2f}</title></rect>'
            )
        body.append(
            f'<text x="{PAD_L + gi * slot + slot / 2:.1f}" y="{PAD_T + plot_h + 12}" font-size="10" '
            f'text-anchor="middle">{_e(gname)}</text>'
        )
    svg = _frame(
        chart_id, title, y_max, 0, 0, body, [(label, PALETTE[i % len(PALETTE)]) for i, (_, label) in enumerate(parts)], y_label
    )
    # A bar chart has no time axis: drop the frame's time labels.
    import re

    return re.sub(r'<text x="[\d.]+" y="%d" font-size="10" text-anchor="middle">[^<]*</text>' % (H - 8), "", svg)
