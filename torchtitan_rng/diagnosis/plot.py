"""``compare_losses --plot out.png``: both loss curves, their difference, and the first divergence marked.

matplotlib is an optional extra (``pip install "torchtitan_rng[plot]"``); without it the option fails with
one line saying so, before anything is compared.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

from torchtitan_rng.errors import TorchtitanRngError


class PlotUnavailable(TorchtitanRngError, RuntimeError):
    """matplotlib is not installed."""


def pyplot() -> ModuleType:
    try:
        import matplotlib
    except ImportError:
        raise PlotUnavailable(
            "--plot needs matplotlib, which is not installed: pip install \"torchtitan_rng[plot]\" "
            "(or pip install matplotlib), or leave out --plot"
        ) from None
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    return plt


def plot_losses(a: dict[int, dict[str, Any]], b: dict[int, dict[str, Any]], first_step: int | None,
                out: Path, labels: tuple[str, str] = ("A", "B")) -> None:
    plt = pyplot()
    figure, (curves, gap) = plt.subplots(2, 1, sharex=True, figsize=(8, 6), height_ratios=(2, 1))
    for records, label, style in ((a, labels[0], "-"), (b, labels[1], "--")):
        steps = sorted(records)
        curves.plot(steps, [float(records[s]["loss"]) for s in steps], style, label=label)
    common = sorted(set(a) & set(b))
    gap.plot(common, [float(b[s]["loss"]) - float(a[s]["loss"]) for s in common], color="tab:red")
    gap.axhline(0.0, color="grey", linewidth=0.5)
    if first_step is not None:
        for axis in (curves, gap):
            axis.axvline(first_step, color="tab:red", linestyle=":", label=f"first divergence: step {first_step}")
    curves.set_ylabel("loss")
    curves.legend()
    curves.set_title("identical" if first_step is None else f"first divergence at step {first_step}")
    gap.set_ylabel(f"loss {labels[1]} - {labels[0]}")
    gap.set_xlabel("step")
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=100)
    plt.close(figure)
