"""Headless Chromium renders a report, embedded figure included (skipped without Chromium)."""

import numpy as np
import pytest
from PIL import Image

from npuq.errors import NpuqError
from npuq.report.html import Figure, Section, Table, figure_png, render
from npuq.report.screenshot import find_chromium, screenshot


def _red_figure():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(3, 2))
    ax.axvspan(0, 1, color=(1.0, 0.0, 0.0))
    ax.set_axis_off()
    return figure_png(fig)


@pytest.mark.skipif(find_chromium() is None, reason="Chromium is not installed (apt-get install chromium)")
def test_chromium_renders_the_embedded_figure_and_text(tmp_path):
    page = tmp_path / "report.html"
    page.write_text(render("title", "sub", [Section("s", [Table(["a"], [[1.5]]), Figure(_red_figure(), "red")])]))
    png = screenshot(page, tmp_path / "shot.png", width=600, height=500)
    pixels = np.asarray(Image.open(png).convert("RGB")).astype(int)
    assert pixels.shape == (500, 600, 3)
    red = (pixels[..., 0] > 200) & (pixels[..., 1] < 60) & (pixels[..., 2] < 60)
    dark = pixels.sum(-1) < 200  # text
    assert red.sum() > 5000 and dark.sum() > 100


def test_missing_page_is_a_clear_error(tmp_path):
    if find_chromium() is None:
        with pytest.raises(NpuqError, match="apt-get install chromium"):
            screenshot(tmp_path / "none.html", tmp_path / "x.png")
    else:
        with pytest.raises(NpuqError, match="no such file"):
            screenshot(tmp_path / "none.html", tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()
