"""Where the replay's time went: one stacked bar (prefill / decode / host seconds) per trajectory, configuration
and executor, drawn from ``bench.replay`` result files.

``python3 -m bench.replay plot JSON... --out PNG`` (or ``python3 -m bench.replay_plot``). Needs matplotlib (the
``bench`` extra, docs/dependencies.md). One panel per result file and executor; bars grouped by trajectory, one per
configuration, each labelled with its total seconds.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

PARTS = (("prefill_ms", "prefill", "#4c72b0"), ("decode_ms", "decode", "#dd8452"), ("host_ms", "host", "#8c8c8c"))


def panels(docs: list[dict]) -> list[tuple[str, list[dict]]]:
    """(title, runs) per result document and executor, in file order."""
    out = []
    for d in docs:
        for ex in dict.fromkeys(r["executor"] for r in d["runs"]):
            sha = (d["commit"] or "?")[:7]
            out.append((f"{d['model']} · {ex} · {d['machine']} ({d['date'][:10]}, {sha})",
                        [r for r in d["runs"] if r["executor"] == ex]))
    return out


def draw(docs: list[dict], out: str | Path) -> Path:
    """Write the PNG of ``docs`` (parsed result files) to ``out``; returns its path. Raises ValueError when the
    documents hold no runs."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ps = panels(docs)
    if not ps:
        raise ValueError("no runs in the given result files")
    fig, axes = plt.subplots(len(ps), 1, figsize=(11, 3.6 * len(ps)), squeeze=False)
    for ax, (title, runs) in zip(axes[:, 0], ps):
        trajs = list(dict.fromkeys(r["trajectory"] for r in runs))
        confs = list(dict.fromkeys(r["config"] for r in runs))
        w = 0.8 / len(confs)
        for j, c in enumerate(confs):
            for i, t in enumerate(trajs):
                run = next((r for r in runs if r["trajectory"] == t and r["config"] == c), None)
                if run is None:
                    continue
                x, bottom = i + (j - (len(confs) - 1) / 2) * w, 0.0
                for key, label, colour in PARTS:
                    v = max(0.0, run["totals"][key]) / 1e3
                    ax.bar(x, v, w * 0.92, bottom=bottom, color=colour, label=label if (i, j) == (0, 0) else None)
                    bottom += v
                ax.text(x, bottom, f"{c}\n{bottom:.1f}s", ha="center", va="bottom", fontsize=6)
        ax.set_xticks(range(len(trajs)))
        ctx = {r["trajectory"]: r["totals"]["context_tokens"] for r in runs}
        ax.set_xticklabels([f"{t}\n{ctx[t]} tokens" for t in trajs], fontsize=8)
        ax.set_ylabel("seconds")
        ax.set_title(title, fontsize=9)
        ax.margins(y=0.18)
        ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m bench.replay plot", description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="+", help="bench.replay result JSON files")
    ap.add_argument("--out", required=True, help="PNG to write")
    a = ap.parse_args(argv)
    p = draw([json.loads(Path(f).read_text()) for f in a.files], a.out)
    print(f"wrote {p}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
