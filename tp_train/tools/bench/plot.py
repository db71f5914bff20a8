"""The benchmark's plot: step time and peak memory per rank against tp, one line per contender kind and size, as
a self-contained SVG written from the benchmark's JSON (no plotting library needed).
"""

from __future__ import annotations

import argparse
import json
import math
from html import escape
from pathlib import Path

PANEL_WIDTH, PANEL_HEIGHT, MARGIN = 360, 240, 56
COLORS = {"ours": "#1f77b4", "native": "#d62728", "plain": "#555555"}
DASHES = ["", "6,3", "2,3", "8,3,2,3"]  # one per size, in the order the benchmark ran them
PANELS = (("step_s", "step time (ms)", 1000.0), ("peak_mib", "peak memory per rank (MiB)", 1.0))


def series(report: dict, key: str, scale: float) -> dict[tuple[str, str], list[tuple[int, float]]]:
    """(size, kind) -> [(tp, value)] for the eager, plain-variant rows of one measurement."""
    lines: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for result in report["results"]:
        for row in result["contenders"].values():
            if row["compiled"] or row["variant"]:
                continue
            lines.setdefault((result["size"]["name"], row["kind"]), []).append((row["tp"], row[key] * scale))
    return {name: sorted(points) for name, points in lines.items()}


def _panel(x0: float, title: str, lines: dict, tps: list[int], sizes: list[str]) -> list[str]:
    """One panel: log2 tp across, log10 value up (sizes differ by 10x)."""
    values = [value for points in lines.values() for _, value in points]
    low, high = math.floor(math.log10(min(values))), math.ceil(math.log10(max(values)))
    high = max(high, low + 1)
    left, top = x0 + MARGIN, MARGIN / 2
    width, height = PANEL_WIDTH - MARGIN - 10, PANEL_HEIGHT - MARGIN

    def x(tp: int) -> float:
        spread = math.log2(max(tps)) or 1.0
        return left + width * (math.log2(tp) / spread if len(tps) > 1 else 0.5)

    def y(value: float) -> float:
        return top + height * (1 - (math.log10(value) - low) / (high - low))

    out = [
        f'<rect x="{left}" y="{top}" width="{width}" height="{height}" fill="none" stroke="#999"/>',
        f'<text x="{left + width / 2}" y="{top - 8}" text-anchor="middle" font-size="13">{escape(title)}</text>',
        f'<text x="{left + width / 2}" y="{top + height + 34}" text-anchor="middle" font-size="12">tp</text>',
    ]
    for tp in tps:
        out.append(f'<text x="{x(tp):.1f}" y="{top + height + 16}" text-anchor="middle" font-size="11">{tp}</text>')
    for power in range(low, high + 1):
        label = f"{10**power:g}"
        out.append(f'<line x1="{left}" x2="{left + width}" y1="{y(10**power):.1f}" y2="{y(10**power):.1f}" '
                   'stroke="#e5e5e5"/>')  # fmt: skip
        out.append(f'<text x="{left - 6}" y="{y(10**power) + 4:.1f}" text-anchor="end" font-size="11">{label}</text>')
    for (size, kind), points in sorted(lines.items()):
        color, dash = COLORS.get(kind, "#000"), DASHES[sizes.index(size) % len(DASHES)]
        path = " ".join(f"{x(tp):.1f},{y(value):.1f}" for tp, value in points)
        out.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2" '
                   f'stroke-dasharray="{dash}"><title>{escape(f"{kind} {size}")}</title></polyline>')  # fmt: skip
        out += [f'<circle cx="{x(tp):.1f}" cy="{y(value):.1f}" r="3" fill="{color}"/>' for tp, value in points]
    return out


def svg(report: dict) -> str:
    """The whole figure: the two panels side by side and a legend of kinds (colour) and sizes (dash)."""
    sizes = [result["size"]["name"] for result in report["results"]]
    tps = sorted({row["tp"] for result in report["results"] for row in result["contenders"].values()})
    body = []
    for index, (key, title, scale) in enumerate(PANELS):
        body += _panel(index * PANEL_WIDTH, title, series(report, key, scale), tps, sizes)
    legend_y = PANEL_HEIGHT + 22  # below the panels' "tp" labels
    for index, kind in enumerate(COLORS):
        x = MARGIN + index * 110
        body.append(f'<line x1="{x}" x2="{x + 24}" y1="{legend_y}" y2="{legend_y}" stroke="{COLORS[kind]}" '
                    'stroke-width="2"/>')  # fmt: skip
        body.append(f'<text x="{x + 30}" y="{legend_y + 4}" font-size="12">{kind}</text>')
    for index, size in enumerate(sizes):
        x = MARGIN + (len(COLORS) + index) * 110
        body.append(f'<line x1="{x}" x2="{x + 24}" y1="{legend_y}" y2="{legend_y}" stroke="#000" '
                    f'stroke-dasharray="{DASHES[index % len(DASHES)]}"/>')  # fmt: skip
        body.append(f'<text x="{x + 30}" y="{legend_y + 4}" font-size="12">{escape(size)}</text>')
    machine = report.get("machine", {})
    note = f"{machine.get('cuda') or str(machine.get('cpus', '?')) + ' CPU cores'}, torch {machine.get('torch', '?')}"
    body.append(f'<text x="{MARGIN}" y="{legend_y + 26}" font-size="11" fill="#555">{escape(note)}</text>')
    width, height = 2 * PANEL_WIDTH, PANEL_HEIGHT + 60
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
        'font-family="sans-serif">\n<rect width="100%" height="100%" fill="white"/>\n' + "\n".join(body) + "\n</svg>\n"
    )


def write_plot(report: dict, path: Path) -> None:
    Path(path).write_text(svg(report))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tp_train.tools.bench.plot", description=__doc__)
    parser.add_argument("json", type=Path, help="the benchmark's JSON (tp-train-bench --output)")
    parser.add_argument("svg", type=Path, help="where the plot goes")
    args = parser.parse_args(argv)
    write_plot(json.loads(args.json.read_text()), args.svg)
    print(f"wrote {args.svg}")


if __name__ == "__main__":
    main()
