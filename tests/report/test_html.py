"""The HTML report is self-contained: escaped text, tables, figures as data URIs."""

import base64
import re
from html.parser import HTMLParser

from npuq.report.html import Figure, Section, Table, figure_png, render


class _Collect(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags, self.srcs, self.cells = [], [], []
        self._in_td = False

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        if tag == "img":
            self.srcs.append(dict(attrs)["src"])
        if tag == "td":
            self._in_td = True
            self.cells.append("")

    def handle_endtag(self, tag):
        if tag == "td":
            self._in_td = False

    def handle_data(self, data):
        if self._in_td:
            self.cells[-1] += data


def test_render_is_self_contained_and_escaped():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.plot([1, 2], [3, 4])
    png = figure_png(fig)
    page = render("npuq <report>", "model x", [
        Section("Perplexity", [Table(["stage", "word ppl"], [["float", 12.3456789], ["<q>", 13]])]),
        Section("Threads", [Figure(png, "sweep"), "a & b", ("pre", "x < y")]),
    ])
    parser = _Collect()
    parser.feed(page)
    assert "script" not in parser.tags and "link" not in parser.tags
    assert len(parser.srcs) == 1 and parser.srcs[0].startswith("data:image/png;base64,")
    assert base64.b64decode(parser.srcs[0].split(",", 1)[1]) == png
    assert parser.cells == ["float", "12.35", "<q>", "13"]
    assert "npuq &lt;report&gt;" in page and "a &amp; b" in page and "x &lt; y" in page
    assert not re.search(r"https?://", page)
