#!/usr/bin/env python3
"""predicted.svg of make cluster-bench: each row of results.tsv as a point, the planner's
predicted step (x) against the measured one (y), one colour per configuration (model, cluster,
rate), the diagonal and the +-15 % band. Standard library only."""
import csv
import math
import sys

COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2"]


def main(tsv, svg):
    rows = []
    with open(tsv) as f:
        for r in csv.DictReader(f, delimiter="\t"):
            try:
                p, m = float(r["predicted_ms"]), float(r["measured_ms"])
            except ValueError:
                continue
            if math.isfinite(p) and math.isfinite(m) and p > 0 and m > 0:
                rows.append((f'{r["model"]} {r["cluster"]} {r["rate"]}', r["row"], p, m))
    W, H, L, B, T, R = 760, 560, 70, 60, 40, 250
    top = max([max(p, m) for _, _, p, m in rows] + [1.0]) * 1.08
    sx = lambda v: L + v / top * (W - L - R)
    sy = lambda v: H - B - v / top * (H - B - T)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
           f'<rect width="{W}" height="{H}" fill="white"/>',
           f'<text x="{L}" y="22" font-size="15">make cluster-bench: predicted against measured step (ms)</text>']
    # +-15 % band and the diagonal
    band = f'{sx(0)},{sy(0)} {sx(top / 1.15)},{sy(top)} {sx(top)},{sy(top)} {sx(top)},{sy(top / 1.15)}'
    out.append(f'<polygon points="{band}" fill="#eeeeee"/>')
    out.append(f'<line x1="{sx(0)}" y1="{sy(0)}" x2="{sx(top)}" y2="{sy(top)}" stroke="#888" stroke-dasharray="4 3"/>')
    for k in range(6):
        v = top * k / 5
        out.append(f'<line x1="{sx(v)}" y1="{sy(0)}" x2="{sx(v)}" y2="{sy(0) + 5}" stroke="black"/>')
        out.append(f'<text x="{sx(v)}" y="{sy(0) + 18}" text-anchor="middle">{v:.0f}</text>')
        out.append(f'<line x1="{sx(0) - 5}" y1="{sy(v)}" x2="{sx(0)}" y2="{sy(v)}" stroke="black"/>')
        out.append(f'<text x="{sx(0) - 8}" y="{sy(v) + 4}" text-anchor="end">{v:.0f}</text>')
    out.append(f'<line x1="{sx(0)}" y1="{sy(0)}" x2="{sx(top)}" y2="{sy(0)}" stroke="black"/>')
    out.append(f'<line x1="{sx(0)}" y1="{sy(0)}" x2="{sx(0)}" y2="{sy(top)}" stroke="black"/>')
    out.append(f'<text x="{(sx(0) + sx(top)) / 2}" y="{H - 15}" text-anchor="middle">predicted step (moec build -v)</text>')
    out.append(f'<text transform="translate(18 {(sy(0) + sy(top)) / 2}) rotate(-90)" text-anchor="middle">'
               f'measured step (median)</text>')
    configs = []
    for c, _, _, _ in rows:
        if c not in configs:
            configs.append(c)
    for c, row, p, m in rows:
        col = COLOURS[configs.index(c) % len(COLOURS)]
        shape = "rect" if row.startswith("fsmoe r=") else "circle"
        if shape == "circle":
            out.append(f'<circle cx="{sx(p):.1f}" cy="{sy(m):.1f}" r="4.5" fill="{col}"><title>{c}: {row} '
                       f'predicted {p:.1f} measured {m:.1f}</title></circle>')
        else:
            out.append(f'<rect x="{sx(p) - 4:.1f}" y="{sy(m) - 4:.1f}" width="8" height="8" fill="none" stroke="{col}" '
                       f'stroke-width="1.5"><title>{c}: {row} predicted {p:.1f} measured {m:.1f}</title></rect>')
    for i, c in enumerate(configs):
        y = T + 20 + 18 * i
        out.append(f'<circle cx="{W - R + 20}" cy="{y - 4}" r="4.5" fill="{COLOURS[i % len(COLOURS)]}"/>')
        out.append(f'<text x="{W - R + 30}" y="{y}">{c}</text>')
    y = T + 20 + 18 * len(configs) + 10
    out.append(f'<text x="{W - R + 20}" y="{y}">dots: policies; squares: fsmoe r sweep</text>')
    out.append(f'<text x="{W - R + 20}" y="{y + 16}">grey: within 15 % of the diagonal</text>')
    out.append("</svg>")
    with open(svg, "w") as f:
        f.write("\n".join(out) + "\n")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
