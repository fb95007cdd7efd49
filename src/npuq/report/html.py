"""A self-contained HTML report: tables and PNG figures embedded as data URIs, no scripts.

The report is built from plain data (sections of tables, figures and preformatted text), so
``report.json`` and ``report.html`` always say the same thing.
"""

from __future__ import annotations

import base64
import html
import io
from dataclasses import dataclass, field
from typing import Any, Sequence

CSS = """
body { font: 15px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #1d232a; padding: 0 1em; }
h1 { font-size: 1.6em; margin-bottom: .2em; } h2 { font-size: 1.2em; margin-top: 2em; border-bottom: 1px solid #d6dbe0; }
.sub { color: #5b6670; margin-top: 0; }
table { border-collapse: collapse; margin: .6em 0; font-variant-numeric: tabular-nums; }
caption { caption-side: bottom; text-align: left; color: #5b6670; font-size: .92em; padding-top: .3em; }
th, td { border: 1px solid #d6dbe0; padding: .3em .7em; text-align: left; vertical-align: top; }
th { background: #f2f4f6; } td.num { text-align: right; }
img { max-width: 100%; border: 1px solid #e4e8eb; margin: .5em 0; }
pre { background: #f6f8fa; padding: .8em; white-space: pre-wrap; border-radius: 4px; }
.note { color: #5b6670; font-size: .92em; }
"""


@dataclass
class Table:
    columns: Sequence[str]
    rows: Sequence[Sequence[Any]]
    caption: str = ""


@dataclass
class Figure:
    png: bytes
    caption: str = ""


@dataclass
class Section:
    title: str
    items: list[Any] = field(default_factory=list)  # Table | Figure | str (paragraph) | ("pre", str)


def figure_png(fig: Any) -> bytes:
    """PNG bytes of a matplotlib figure (closed afterwards)."""
    # matplotlib (0.2-0.6 s) loads only to draw a figure
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def _cell(value: Any) -> str:
    if isinstance(value, float):
        text = f"{value:.4g}" if abs(value) < 1e5 else f"{value:.3e}"
        return f'<td class="num">{text}</td>'
    if isinstance(value, int) and not isinstance(value, bool):
        return f'<td class="num">{value}</td>'
    return f"<td>{html.escape('' if value is None else str(value))}</td>"


def _render(item: Any) -> str:
    if isinstance(item, Table):
        head = "".join(f"<th>{html.escape(str(c))}</th>" for c in item.columns)
        body = "".join("<tr>" + "".join(_cell(v) for v in row) + "</tr>" for row in item.rows)
        cap = f"<caption>{html.escape(item.caption)}</caption>" if item.caption else ""
        return f"<table>{cap}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
    if isinstance(item, Figure):
        data = base64.b64encode(item.png).decode("ascii")
        cap = f'<div class="note">{html.escape(item.caption)}</div>' if item.caption else ""
        return f'<figure><img alt="{html.escape(item.caption)}" src="data:image/png;base64,{data}">{cap}</figure>'
    if isinstance(item, tuple) and item and item[0] == "pre":
        return f"<pre>{html.escape(item[1])}</pre>"
    return f"<p>{html.escape(str(item))}</p>"


def render(title: str, subtitle: str, sections: Sequence[Section]) -> str:
    parts = [
        "<!doctype html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{html.escape(title)}</title><style>{CSS}</style></head><body>",
        f"<h1>{html.escape(title)}</h1><p class='sub'>{html.escape(subtitle)}</p>",
    ]
    for section in sections:
        parts.append(f"<h2>{html.escape(section.title)}</h2>")
        parts.extend(_render(item) for item in section.items)
    parts.append("</body></html>")
    return "\n".join(parts)
