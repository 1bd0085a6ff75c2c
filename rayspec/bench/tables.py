"""The one table writer of every bench suite: a Markdown table (title, rows, notes) and the same rows as CSV."""

from __future__ import annotations

import csv


def write_table(stem: str, title: str, header: list[str], cells: list[list], notes: str = "") -> str:
    """Write ``<stem>.md`` (title, table, then ``notes``) and ``<stem>.csv``; returns the Markdown."""
    md = [f"### {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    md += ["| " + " | ".join(str(c) for c in row) + " |" for row in cells]
    text = "\n".join(md) + "\n" + notes
    with open(stem + ".md", "w") as f:
        f.write(text)
    with open(stem + ".csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(cells)
    return text
