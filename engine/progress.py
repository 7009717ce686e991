"""A one-line progress bar on stderr (`label [#####.....] detail`), redrawn in place
and erased when done: the prefill of `engine run` and the downloads of `engine pull`."""
from __future__ import annotations

import sys

WIDTH = 30


class ProgressLine:
    def __init__(self, stream=None):
        self.stream = stream or sys.stderr
        self.shown = False

    def draw(self, label: str, done: int, total: int, detail: str) -> None:
        fill = WIDTH * done // max(total, 1)
        self.stream.write(f"\r{label} [{'#' * fill}{'.' * (WIDTH - fill)}] {detail}\x1b[K")
        self.stream.flush()
        self.shown = True

    def close(self) -> None:
        if self.shown:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self.shown = False
