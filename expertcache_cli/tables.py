"""Tables that never lose a character of a number.

rich shortens a cell that does not fit with an ellipsis, so at 80 columns (and in a pipe,
where rich assumes 80) `replay` printed "473,6…" for 473,601 misses: a number a user sizes
a deployment from, silently wrong. Every table of the CLI comes from here. Its values are
never cut or broken (a column of prose, ``text=True``, wraps at spaces instead); headers
wrap at spaces and, if a word is too long, fold. When the
values themselves are wider than the terminal, whole columns are left out, the least
important first (``keep=`` of `add_column`, lower goes first; ties: the rightmost), and a
line under the table names them and how to see everything (a wider terminal, or
``--json``).
"""

from __future__ import annotations

from typing import Any

from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, RenderResult
from rich.table import Table as _RichTable
from rich.text import Text

__all__ = ["Table"]


def _plain(cell: Any) -> str:
    return cell.plain if isinstance(cell, Text) else str(cell)


class Table(_RichTable):
    """`rich.table.Table` that fits by dropping columns, never by cutting values."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._keep: list[int] = []
        self._text: list[bool] = []

    def add_column(self, *args: Any, keep: int = 0, text: bool = False, **kwargs: Any) -> None:
        kwargs.setdefault("overflow", "fold")
        super().add_column(*args, **kwargs)
        self._keep.append(keep)
        self._text.append(text)

    def _need(self, index: int) -> int:
        """Width a column needs: its widest value (a prose column: its longest word), its
        longest header word, and the cell padding and rule."""
        col = self.columns[index]
        lines = [line for c in col._cells for line in _plain(c).splitlines()]
        if self._text[index]:
            lines = [w for line in lines for w in line.split()]
        words = _plain(col.header).split()
        return max([1, *map(cell_len, lines), *map(cell_len, words)]) + 3

    def _fix_widths(self, need: dict[int, int], width: int) -> None:
        """Every column gets an exact width: a value column its widest value (its header
        wraps within it); prose columns share what is left, in proportion to their natural
        widths and at least their longest word."""
        cols = range(len(self.columns))
        for i in cols:
            if not self._text[i]:
                self.columns[i].width = need[i] - 3
        prose = [i for i in cols if self._text[i]]
        spare = width - 1 - sum(need[i] for i in cols)
        natural = {i: self._natural(i) - need[i] for i in prose}
        total = sum(natural.values()) or 1
        for i in prose:
            extra = min(natural[i], spare * natural[i] // total) if spare > 0 else 0
            self.columns[i].width = need[i] - 3 + max(0, extra)

    def _natural(self, index: int) -> int:
        """Width a column takes when nothing has to wrap."""
        col = self.columns[index]
        cells = [col.header, *col._cells]
        return max(cell_len(line) for c in cells for line in (_plain(c).splitlines() or [""])) + 3

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        width = options.max_width
        shown = list(range(len(self.columns)))
        need = {i: self._need(i) for i in shown}
        order = sorted(shown, key=lambda i: (self._keep[i], -i))
        dropped: list[int] = []
        while len(shown) > 1 and sum(need[i] for i in shown) + 1 > width:
            worst = order.pop(0)
            shown.remove(worst)
            dropped.append(worst)
        if not dropped:
            if sum(self._natural(i) for i in shown) + 1 > width:
                self._fix_widths(need, width)
            yield from super().__rich_console__(console, options)
            return
        fitted = Table(
            title=self.title, show_header=self.show_header, box=self.box,
            show_edge=self.show_edge, padding=self.padding, expand=self.expand,
            title_style=self.title_style, header_style=self.header_style,
        )
        for i in shown:
            col = self.columns[i]
            fitted.add_column(col.header, justify=col.justify, style=col.style,
                              text=self._text[i])
        fitted._fix_widths({k: need[i] for k, i in enumerate(shown)}, width)
        for r in range(self.row_count):
            fitted.add_row(*(self.columns[i]._cells[r] for i in shown))
        yield fitted
        names = ", ".join(" ".join(_plain(self.columns[i].header).split()) or f"#{i + 1}"
                          for i in sorted(dropped))
        yield Text(f"(left out to fit {width} columns: {names}; a wider terminal or --json "
                   "shows them)", style="dim")
