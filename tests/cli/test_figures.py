"""The figures of `fewbit-design plot` and `curves` read at a glance: their structure, not pixels.

Each test runs the command and keeps the figure it renders (``plots.figure_bytes`` is wrapped), then checks axes,
labels, legends and lines: the weight is a labelled density curve on its own axis (it was a grey band on an axis
without ticks or label), and in ``curves`` every activation has its own marker and line style, with one legend
outside the panels (gelu and silu coincided, and the legend sat on the data).
"""

from __future__ import annotations

import pytest

from fewbit_design import plots
from fewbit_design.cli import main

WEIGHT_AXIS_LABEL = "weight w(x) (density)"


@pytest.fixture
def figures(monkeypatch):
    """The figures the command renders, in order (they are still written)."""
    saved = []
    original = plots.figure_bytes

    def keep(figure, path):
        saved.append(figure)
        return original(figure, path)

    monkeypatch.setattr(plots, "figure_bytes", keep)
    return saved


def run(capsys, *args) -> None:
    with pytest.raises(SystemExit) as info:
        main(list(args))
    assert info.value.code == 0, capsys.readouterr().err


def _weight_axes(figure, axes):
    """The twin of ``axes`` (same position, another axes object)."""
    twins = [other for other in figure.axes if other is not axes and other.bbox.bounds == axes.bbox.bounds]
    assert len(twins) == 1, f"{axes.get_title()!r}: expected one twin axis for the weight, got {len(twins)}"
    return twins[0]


def test_plot_draws_the_weight_as_a_density_on_its_own_labelled_axis(capsys, tmp_path, figures):
    run(capsys, "plot", "gelu", "--bits", "1,3", "--weight", "normal", "--out", str(tmp_path / "gelu.png"))
    (figure,) = figures
    figure.canvas.draw()
    panels = [a for a in figure.axes if a.get_xlabel() == "x (pre-activation)"]
    assert len(panels) == 2  # one per bit width
    for axes in panels:
        weight_axes = _weight_axes(figure, axes)
        assert weight_axes.get_ylabel() == WEIGHT_AXIS_LABEL
        assert weight_axes.yaxis.get_label_position() == "right"
        ticks = [t for t in weight_axes.get_yticks() if weight_axes.get_ylim()[0] <= t <= weight_axes.get_ylim()[1]]
        assert len(ticks) >= 3, "the weight axis shows its scale"
        (curve,) = weight_axes.get_lines()  # the density, drawn as a line
        assert curve.get_label() == "weight w(x)" and curve.get_linestyle() == "--"
        assert max(curve.get_ydata()) <= weight_axes.get_ylim()[1]
        assert [line.get_label() for line in axes.get_lines()] == ["f'(x)"]  # (q(x) is a stairs patch)
        legend = axes.get_legend()
        assert [text.get_text() for text in legend.get_texts()] == ["f'(x)", "q(x)", "weight w(x)"]
        assert axes.get_zorder() > weight_axes.get_zorder()  # the data is drawn over the weight


def test_design_plot_draws_the_weight_on_its_own_labelled_axis(capsys, tmp_path, figures):
    out = tmp_path / "table.json"
    plot = str(tmp_path / "t.png")
    run(capsys, "relu6", "--bits", "1", "--weight", "normal", "--grid", "401", "--out", str(out), "--plot", plot)
    (figure,) = figures
    axes, weight_axes = figure.axes
    assert weight_axes.get_ylabel() == WEIGHT_AXIS_LABEL
    assert [line.get_label() for line in weight_axes.get_lines()] == ["weight w(x), normal"]


def test_curves_lines_are_distinguishable_and_the_legend_is_outside_the_data(capsys, tmp_path, figures):
    names = ["gelu", "silu", "tanh"]
    run(capsys, "curves", *names, "--bits", "1-3", "--weight", "normal", "--out", str(tmp_path / "curves.png"))
    (figure,) = figures
    figure.canvas.draw()
    assert len(figure.axes) == 4
    for axes in figure.axes:
        lines = axes.get_lines()
        assert [line.get_label() for line in lines] == names  # one line per activation
        styles = {(line.get_marker(), line.get_linestyle()) for line in lines}
        assert len(styles) == len(names), f"two activations share marker and line style: {styles}"
        assert axes.get_legend() is None  # no legend over the data
    (legend,) = figure.legends
    assert [text.get_text() for text in legend.get_texts()] == names
    box = legend.get_window_extent()
    right = max(axes.get_window_extent().x1 for axes in figure.axes)
    assert box.x0 >= right, "the legend sits to the right of every panel"


FACTORY = """
import torch

def mlp():
    torch.manual_seed(0)
    nn = torch.nn
    return nn.Sequential(*[nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)) for _ in range(4)])
"""


def test_event_edges_put_unmarked_events_evenly_between_marks():
    from fewbit_design.cli.memory import event_edges

    assert event_edges(["a", "b", "c"], {"a": 3, "b": 9, "c": 10}, 12) == [0.0, 3.0, 9.0, 12.0]
    assert event_edges(["a", "b", "c", "d"], {"a": 2, "c": 10}, 12) == [0.0, 2.0, 6.0, 10.0, 12.0]
    assert event_edges(["a", "b"], {}, 8) == [0.0, 4.0, 8.0]  # no marks: the events share the step evenly


def test_memory_timeline_draws_predicted_and_measured_on_one_axis_with_both_peaks(capsys, tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    from fewbit_design.runtime.planner import load_plan

    name = f"figure_models_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(FACTORY)
    monkeypatch.chdir(tmp_path)
    closed = []
    monkeypatch.setattr(plt, "close", closed.append)  # keeps the figure that plot_plan draws
    plan_path = tmp_path / "plan.json"
    args = ["memory", f"{name}:mlp", "--input-shape", "32,16", "--budget", "min", "--measure", "--allow", "checkpoint"]
    run(capsys, *args, "--plot", str(tmp_path / "memory.png"), "--save", str(plan_path))
    (figure,) = closed
    figure.canvas.draw()
    timeline = next(axes for axes in figure.axes if axes.get_title() == "peak-memory timeline")
    assert timeline.get_xlabel().startswith("operators of the step")
    measured = load_plan(plan_path).measured
    (predicted,) = [patch for patch in timeline.patches if patch.get_label() == "predicted"]
    (measured_line,) = [line for line in timeline.get_lines() if line.get_label() == "measured"]
    # one x axis: the predicted events span exactly the measured operators, and each block's forward ends where
    # the measured step's does
    edges = predicted.get_data().edges
    assert edges[0] == 0 and edges[-1] == len(measured["timeline"]) == len(measured_line.get_xdata())
    assert set(measured["marks"].values()) <= set(edges)
    # both peaks are marked, at their values
    labels = [line.get_label() for line in timeline.get_lines()]
    (predicted_peak,) = [line for line in timeline.get_lines() if line.get_label().startswith("predicted peak")]
    (measured_peak,) = [line for line in timeline.get_lines() if line.get_label().startswith("measured peak")]
    assert measured_peak.get_ydata()[0] == max(measured_line.get_ydata()), labels
    assert predicted_peak.get_ydata()[0] == max(predicted.get_data().values)
    # the legend sits outside the data, to the right of the panel
    assert timeline.get_legend().get_window_extent().x0 >= timeline.get_window_extent().x1


@pytest.mark.parametrize("weight", ["uniform", "normal"])
def test_the_weight_axis_is_a_density_over_the_whole_design_range(capsys, tmp_path, figures, weight):
    """The curve labelled a density integrates to 1 over the x axis, which spans the design range [-10, 10] (the
    uniform weight was drawn at 1.0 on a window clipped to about +-4.8)."""
    import numpy as np

    run(capsys, "plot", "gelu", "--bits", "2", "--weight", weight, "--out", str(tmp_path / "gelu.png"))
    (figure,) = figures
    (axes,) = [a for a in figure.axes if a.get_xlabel() == "x (pre-activation)"]
    assert axes.get_xlim() == (-10.0, 10.0)
    (curve,) = _weight_axes(figure, axes).get_lines()
    area = np.trapezoid(curve.get_ydata(), curve.get_xdata())
    assert area == pytest.approx(1.0, rel=1e-9)
    assert curve.get_xdata().min() == -10.0 and curve.get_xdata().max() == 10.0
