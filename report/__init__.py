"""``offloadctl report``: where every iteration's time, memory and bandwidth went, for any run.

- :mod:`.load`: a run directory's records (``report/recorder.py``), with one-line errors;
- :mod:`.analyze`: the numbers behind every plot (pure functions; ``--json`` prints them);
- :mod:`.plots`: one matplotlib figure per section;
- :mod:`.render`: PNG files, the self-contained HTML page, the terminal summary.

:func:`build_report` runs them in that order.
"""

from __future__ import annotations

from report.analyze import analyze
from report.load import Run, load_run


def build_report(
    run_dirs: list[str], *, iteration: int | None = None, rank: int | None = None, labels: list[str] | None = None
) -> tuple[dict, dict[str, bytes]]:
    """(the numbers, {section: PNG bytes}) for ``run_dirs``, side by side, the first the baseline."""
    from report.plots import figures, png_bytes

    runs = [load_run(d, rank=rank, label=(labels[k] if labels and k < len(labels) else None)) for k, d in enumerate(run_dirs)]
    analysis = analyze(runs, iteration)
    pngs = {name: png_bytes(fig) for name, fig in figures(analysis).items()}
    return analysis, pngs


__all__ = ["Run", "analyze", "build_report", "load_run"]
