"""Error heat maps of the failing stages (`check --plot`): |got - want| over the allowed bound, per
element and per tile, one PNG per stage and head (matplotlib, optional)."""
from __future__ import annotations

import io
import os
import stat
from pathlib import Path
from typing import List, Optional

import numpy as np

from ..check.results import FAIL, INHERITED, Report
from ..files.case import atomic_write_bytes, file_kind, probe_writable
from ..files.kinds import CaseError
from ..stages import STAGES, stage_file
from ..text import plural


def check_plot_folder(folder: Path) -> None:
    """The plot folder is a folder, or nothing yet (it is created): anything else is refused, and
    so is a place no file can be written (the maps come after the whole check)."""
    folder = Path(folder)
    try:
        st = os.stat(folder)
    except FileNotFoundError:
        parent = next((p for p in folder.absolute().parents if p.exists()), None)
        if parent is None or not parent.is_dir():
            raise CaseError(f"{folder}: cannot create the plot folder under {parent}") from None
        probe_writable(parent, folder)
        return
    except OSError as exc:
        raise CaseError(f"{folder}: cannot use as the plot folder: {exc.strerror or exc}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise CaseError(f"{folder}: is {file_kind(st.st_mode)}, not a folder for the plots")
    probe_writable(folder, folder)


# What a tile of a stage's rows or columns is, by the stage table's dimension symbol: the
# columns of QK, QK_scaled and attention_weights are keys, those of output are value columns.
_TILE_NAMES = {"N": "query tile", "M": "key tile", "DK": "{axis} tile", "DV": "{axis} tile", "1": None,
               "SDV": "{axis} tile (the splits side by side)", "S": "split"}


def tile_axis_name(stage: str, axis: str) -> Optional[str]:
    """The label of the tile grid's `axis` ("row" or "column") for `stage`; None for a one-wide axis."""
    sym = getattr(STAGES[stage], "rows" if axis == "row" else "cols")
    name = _TILE_NAMES[sym]
    return name.format(axis=axis) if name else None


def _tile_grid(shown: np.ndarray, br: int, bc: int) -> np.ndarray:
    """The maximum of `shown` over each br x bc tile."""
    tr, tc = -(-shown.shape[0] // br), -(-shown.shape[1] // bc)
    grid = np.zeros((tr, tc))
    for i in range(tr):
        for j in range(tc):
            grid[i, j] = shown[i * br:(i + 1) * br, j * bc:(j + 1) * bc].max()
    return grid


def error_figure(stage: str, head: int, ratio: np.ndarray, tiles, kv: bool = False, sequence: Optional[int] = None):
    """The figure of one stage x head: log10(|error| / allowed) per element, and its maximum per
    tile (`tiles` = (rows, cols) of a tile), with integer ticks and axes named after what they hold."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    br, bc = tiles
    shown = np.log10(np.clip(np.where(np.isfinite(ratio), ratio, 1e6), 1e-3, 1e6))
    row_name, col_name = tile_axis_name(stage, "row"), tile_axis_name(stage, "column")
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    im = axes[0].imshow(shown, aspect="auto", cmap="magma", vmin=-3, vmax=6, interpolation="nearest")
    seq = "" if sequence is None else f", sequence {sequence}"
    axes[0].set_title(f"{stage} {'K/V head' if kv else 'head'} {head}{seq}: log10(|err| / allowed)")
    axes[0].set_xlabel("column")
    axes[0].set_ylabel("row")
    fig.colorbar(im, ax=axes[0])
    im2 = axes[1].imshow(_tile_grid(shown, br, bc), aspect="auto", cmap="magma", vmin=-3, vmax=6,
                         interpolation="nearest")
    axes[1].set_title(f"max per {br}x{bc} tile" if col_name else f"max per {plural(br, 'row')}")
    axes[1].set_ylabel(row_name or "")
    axes[1].set_xlabel(col_name or "")
    for ax in axes:
        ax.yaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
        ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
    if col_name is None:
        axes[1].set_xticks([])
    fig.colorbar(im2, ax=axes[1])
    fig.tight_layout()
    return fig


def write_plots(report: Report, folder: Path, error_map) -> List[Path]:
    """One PNG per failing stage × head: |error| / allowed as a heat map, and its per-tile maximum.
    `error_map(stage, head, sequence)` returns that ratio array (compare.error_ratio_map; head: a
    K/V head for a grouped case's K/V stages, as the result and its file number it; sequence: a
    packed case's, else None). A packed case's exact checks (the key rows no query reads, a
    sequence without keys) have no reference to map."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise CaseError("--plot needs matplotlib: pip install 'attnstep[plot]' (or pip install matplotlib)")
    folder = Path(folder)
    check_plot_folder(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CaseError(f"{folder}: cannot create the plot folder: {exc.strerror or exc}") from None
    tiles = report.run.flash_tiles or (64, 64)
    written = []
    for r in report.results:
        if r.status != FAIL and r.status != INHERITED:
            continue
        sequence = getattr(r, "sequence", None)
        if getattr(r, "packed", False) and (sequence is None or not report.case.sequences.m(sequence)):
            continue
        fig = error_figure(r.stage, r.head, error_map(r.stage, r.head, sequence), tiles, r.kv, sequence)
        path = folder / stage_file(r.stage, r.head, "png", seq=sequence)
        png = io.BytesIO()
        fig.savefig(png, format="png", dpi=90)
        plt.close(fig)
        atomic_write_bytes(path, png.getvalue(), through_links=False)  # a link planted there is replaced, not followed
        written.append(path)
    return written
