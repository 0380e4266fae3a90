"""`attnstep bench --plot`: TFLOP/s against N, one line per kernel and precision, one panel per
head width and masking."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

from ..files.matrix_io import output_file_target
from .report import SDPA, SDPA_BACKWARD, SDPA_RUN_KEYS, BenchError, Row, sdpa_backend_row
from .sdpa import SDPA_BACKENDS as SDPA_BACKEND_NAMES

# PyTorch's rows, the yardsticks: black, its backward grey, both dashed.
_SDPA_COLOURS = {SDPA: "black", SDPA_BACKWARD: "grey"}


def _plotted(rows: Sequence[Row]) -> List[Row]:
    """Rows with a TFLOP/s figure. SDPA, forward and backward: its fp32 run (tf32 times the same
    fused kernels again) and its fastest backend at bf16/fp16; the backends one by one stay in the
    table."""
    backend_rows = {sdpa_backend_row(name, sdpa) for sdpa, _ in SDPA_RUN_KEYS.values() for name in SDPA_BACKEND_NAMES}
    return [r for r in rows if r.status == "ok" and r.kind in ("attention", "gemm") and r.rate
            and r.kernel not in backend_rows and not (r.kernel in _SDPA_COLOURS and r.precision == "tf32")]


def _kernel_colours(rows: Sequence[Row], cycle: Sequence[str]) -> Dict[str, str]:
    """One colour per kernel in every panel (with one line style per precision a dozen lines stay
    tellable apart; the default colour cycle repeats after ten); SDPA, the yardstick, in black."""
    kernels = sorted({r.kernel for r in rows if r.kernel not in _SDPA_COLOURS})
    colour = {k: cycle[i % len(cycle)] for i, k in enumerate(kernels)}
    colour.update(_SDPA_COLOURS)
    return colour


def _draw_panel(ax, rows: Sequence[Row], d: int, causal: bool, colour: Dict[str, str]) -> None:
    style = {"fp32": "-", "tf32": ":", "bf16": "-.", "fp16": (0, (5, 2, 1, 2, 1, 2))}
    series: Dict[Tuple[str, str], List[Row]] = {}
    for r in rows:
        if (r.d, r.causal) == (d, causal):
            series.setdefault((r.kernel, r.precision), []).append(r)
    for (kernel, precision), pts in sorted(series.items()):
        pts = sorted(pts, key=lambda r: r.n)
        sdpa_fp32 = kernel in _SDPA_COLOURS and precision == "fp32"
        label = kernel if sdpa_fp32 else f"{kernel} {precision}"
        ax.plot([p.n for p in pts], [p.rate for p in pts], marker="o", markersize=3, label=label,
                color=colour[kernel], linestyle="--" if sdpa_fp32 else style.get(precision, "-"))
    ax.set_xscale("log", base=2)
    ax.set_xlabel("N = M")
    ax.set_ylabel("TFLOP/s")
    ax.set_title(f"d={d} {'causal' if causal else 'non-causal'}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=6)


def _panel_grid(panels: Sequence[Tuple[int, bool]]) -> Tuple[List[int], List[bool]]:
    """The plot's columns (d) and rows (causal or not)."""
    return sorted({d for d, _ in panels}), sorted({c for _, c in panels})


def _save_atomically(fig, path: Path) -> None:
    """A PNG appears complete or not at all (an interrupted save leaves no half-written file)."""
    target = output_file_target(path)
    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    try:
        fig.savefig(tmp, dpi=120, format="png")
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_plot(rows: Sequence[Row], path: Path, title: str = "") -> None:
    """TFLOP/s against N, one line per kernel and precision; one panel per d (columns) and
    masking (rows)."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    plotted = _plotted(rows)
    panels = {(r.d, r.causal) for r in plotted}
    if not panels:
        raise BenchError("nothing to plot: no kernel with a TFLOP/s figure")
    colour = _kernel_colours(plotted, plt.rcParams["axes.prop_cycle"].by_key()["color"])
    ds, masks = _panel_grid(panels)
    fig, axes = plt.subplots(len(masks), len(ds), figsize=(4.2 * len(ds), 3.8 * len(masks)), squeeze=False)
    for i, causal in enumerate(masks):
        for j, d in enumerate(ds):
            if (d, causal) in panels:
                _draw_panel(axes[i][j], plotted, d, causal, colour)
            else:
                axes[i][j].set_axis_off()
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    try:
        _save_atomically(fig, path)
    finally:
        plt.close(fig)
