"""Fan charts: history, median and shaded quantile bands, one panel per series (matplotlib, Agg)."""

from __future__ import annotations

import io
import math
from typing import Sequence

from gencli.io import write_output
from gencli.pipelines.forecast.request import NO_MATPLOTLIB, plot_format


def _bands(levels: Sequence[float], grid_levels: Sequence[float]):
    """Symmetric pairs (lo, hi) to shade, widest first: the requested ones when it has pairs, else
    the model grid's 80% and 50% intervals."""
    levels = [float(q) for q in levels]
    pairs = [(q, round(1 - q, 10)) for q in levels if q < 0.5 and round(1 - q, 10) in [round(x, 10) for x in levels]]
    if pairs:
        return "requested", sorted(pairs)
    return "grid", [(0.1, 0.9), (0.25, 0.75)] if 0.25 in grid_levels else [(0.1, 0.9), (0.3, 0.7)]


def fan_chart(items: list[dict], levels: Sequence[float], path: str, force: bool = False) -> None:
    """Draw the panels ``items`` (:func:`~gencli.pipelines.forecast.outputs.plot_item`) and write the
    chart to ``path`` in the format its name says (:func:`~gencli.pipelines.forecast.request.plot_format`),
    through the output layer: a file atomically, ``-``, a pipe or a device in place."""
    write_output(path, chart_bytes(items, levels, plot_format(path) or "png"), force)


def chart_bytes(items: list[dict], levels: Sequence[float], fmt: str) -> bytes:
    """The fan chart of ``items`` rendered in memory as ``fmt`` (png, svg, pdf, jpeg): the image
    writers seek, which a pipe cannot take."""
    try:
        import matplotlib
    except ImportError:
        from gencli.errors import UserError

        raise UserError(NO_MATPLOTLIB) from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from gencli.pipelines.forecast.metrics import interpolate_quantiles

    n = len(items)
    cols = 1 if n == 1 else (2 if n <= 4 else 3)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, 3.0 * rows), squeeze=False)
    source, pairs = _bands(levels, items[0]["grid_levels"] if items else [])
    for ax, item in zip(axes.flat, items):
        ax.plot(item["hist_t"], item["hist_y"], color="#333333", lw=1.2, label="history")
        if source == "requested":
            lv = [round(float(q), 10) for q in levels]
            get = lambda q, item=item, lv=lv: item["quantiles"][:, lv.index(round(q, 10))]  # noqa: E731
        else:
            get = lambda q, item=item: interpolate_quantiles(item["grid"], item["grid_levels"], [q])[:, 0]  # noqa: E731
        t = item["fut_t"]
        for k, (lo, hi) in enumerate(pairs):
            alpha = 0.18 + 0.5 * k / max(1, len(pairs))
            ax.fill_between(t, get(lo), get(hi), color="#1f77b4", alpha=alpha, lw=0, label=f"{int(round((hi - lo) * 100))}% interval")
        median = interpolate_quantiles(item["grid"], item["grid_levels"], [0.5])[:, 0]
        ax.plot(t, median, color="#1f77b4", lw=1.6, label="median")
        if len(t) and len(item["hist_t"]):
            ax.plot([item["hist_t"][-1], t[0]], [item["hist_y"][-1], median[0]], color="#1f77b4", lw=1.0, ls=":")
        ax.set_title(str(item["id"]), fontsize=10)
        ax.tick_params(labelsize=8)
        for label in ax.get_xticklabels():
            label.set_rotation(25)
            label.set_horizontalalignment("right")
        ax.grid(alpha=0.25)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    if items:
        axes.flat[0].legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    buf = io.BytesIO()
    try:
        fig.savefig(buf, dpi=110, format=fmt)
    finally:
        plt.close(fig)
    return buf.getvalue()
