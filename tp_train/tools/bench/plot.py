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


def panel(x0: float, title: str, lines: dict, styles: dict, xs: list, x_label: str, log: bool = True) -> list[str]:
    """One panel: each of `lines` ({name: [(x, value)]}) in its `styles[name]` (colour, dash), log2 x across (`xs`
    the ticks), the value up: log10 with `log` (sizes differ by 10x), else linear from 0."""
    values = [value for points in lines.values() for _, value in points]
    if log:
        low, high = math.floor(math.log10(min(values))), math.ceil(math.log10(max(values)))
        high = max(high, low + 1)
        ticks = [10**power for power in range(low, high + 1)]
    else:
        low, high = 0.0, max(values) * 1.1
        ticks = [0.0, high / 2, high]
    left, top = x0 + MARGIN, MARGIN / 2
    width, height = PANEL_WIDTH - MARGIN - 10, PANEL_HEIGHT - MARGIN

    def x(value: float) -> float:
        spread = math.log2(max(xs) / min(xs))
        return left + width * (math.log2(value / min(xs)) / spread if spread else 0.5)

    def y(value: float) -> float:
        return top + height * (1 - ((math.log10(value) if log else value) - low) / (high - low))

    out = [
        f'<rect x="{left}" y="{top}" width="{width}" height="{height}" fill="none" stroke="#999"/>',
        f'<text x="{left + width / 2}" y="{top - 8}" text-anchor="middle" font-size="13">{escape(title)}</text>',
        f'<text x="{left + width / 2}" y="{top + height + 34}" text-anchor="middle" font-size="12">{x_label}</text>',
    ]
    for tick in xs:
        out.append(f'<text x="{x(tick):.1f}" y="{top + height + 16}" text-anchor="middle" font-size="11">{tick}</text>')
    for tick in ticks:
        label = f"{tick:g}" if log else f"{tick:.0f}"
        out.append(f'<line x1="{left}" x2="{left + width}" y1="{y(tick):.1f}" y2="{y(tick):.1f}" stroke="#e5e5e5"/>')
        out.append(f'<text x="{left - 6}" y="{y(tick) + 4:.1f}" text-anchor="end" font-size="11">{label}</text>')
    for name, points in sorted(lines.items()):
        (color, dash), path = styles[name], " ".join(f"{x(n):.1f},{y(value):.1f}" for n, value in points)
        out.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2" '
                   f'stroke-dasharray="{dash}"><title>{escape(name)}</title></polyline>')  # fmt: skip
        out += [f'<circle cx="{x(n):.1f}" cy="{y(value):.1f}" r="3" fill="{color}"/>' for n, value in points]
    return out


def legend(entries: list[tuple[str, str, str]], top: float, per_row: int = 8, spacing: float = 110) -> list[str]:
    """A line in its colour and dash and the name, for each (name, colour, dash), `per_row` a row from `top`."""
    out = []
    for index, (name, color, dash) in enumerate(entries):
        x, y = MARGIN + index % per_row * spacing, top + index // per_row * 18
        out.append(f'<line x1="{x}" x2="{x + 24}" y1="{y}" y2="{y}" stroke="{color}" stroke-width="2" '
                   f'stroke-dasharray="{dash}"/>')  # fmt: skip
        out.append(f'<text x="{x + 30}" y="{y + 4}" font-size="12">{escape(name)}</text>')
    return out


def figure(body: list[str], width: float, height: float) -> str:
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
        'font-family="sans-serif">\n<rect width="100%" height="100%" fill="white"/>\n' + "\n".join(body) + "\n</svg>\n"
    )


def svg(report: dict) -> str:
    """The whole figure: the two panels side by side and a legend of kinds (colour) and sizes (dash)."""
    sizes = [result["size"]["name"] for result in report["results"]]
    tps = sorted({row["tp"] for result in report["results"] for row in result["contenders"].values()})
    dashes = {size: DASHES[index % len(DASHES)] for index, size in enumerate(sizes)}
    styles = {f"{kind} {size}": (color, dashes[size]) for kind, color in COLORS.items() for size in sizes}
    body = []
    for index, (key, title, scale) in enumerate(PANELS):
        lines = {f"{kind} {size}": points for (size, kind), points in series(report, key, scale).items()}
        body += panel(index * PANEL_WIDTH, title, lines, styles, tps, "tp")
    legend_y = PANEL_HEIGHT + 22  # below the panels' "tp" labels
    kinds = [(kind, color, "") for kind, color in COLORS.items()]
    body += legend(kinds + [(size, "#000", dash) for size, dash in dashes.items()], legend_y)
    machine = report.get("machine", {})
    note = f"{machine.get('cuda') or str(machine.get('cpus', '?')) + ' CPU cores'}, torch {machine.get('torch', '?')}"
    body.append(f'<text x="{MARGIN}" y="{legend_y + 26}" font-size="11" fill="#555">{escape(note)}</text>')
    return figure(body, 2 * PANEL_WIDTH, PANEL_HEIGHT + 60)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tp_train.tools.bench.plot", description=__doc__)
    parser.add_argument("json", type=Path, help="the benchmark's JSON (tp-train-bench --output)")
    parser.add_argument("svg", type=Path, help="where the plot goes")
    args = parser.parse_args(argv)
    args.svg.write_text(svg(json.loads(args.json.read_text())))
    print(f"wrote {args.svg}")


if __name__ == "__main__":
    main()
