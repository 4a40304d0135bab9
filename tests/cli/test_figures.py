"""The figures of `fewbit-design plot` and `curves` read at a glance (issue 24 item 4): their structure, not pixels.

Each test runs the command and keeps the figure it saves (``plots.save_figure`` is wrapped), then checks axes,
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
    """The figures the command saves, in order (they are still written)."""
    saved = []
    original = plots.save_figure

    def keep(figure, path, *, force=False):
        saved.append(figure)
        return original(figure, path, force=force)

    monkeypatch.setattr(plots, "save_figure", keep)
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
