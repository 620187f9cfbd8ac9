"""A one-line progress report for long host work (compiling kernels): ``k/N kernels (c
cached), elapsed``, rewritten in place on a TTY, one line at the end elsewhere."""

import sys
import time


class Progress:
    """Call it once an item is done (``cached``: loaded, not compiled); ``close()`` ends
    the line. ``stream``: where (stderr)."""

    def __init__(self, total: int, what: str = "kernels", stream=None):
        self.total, self.what, self.stream = total, what, stream or sys.stderr
        self.done = self.cached = 0
        self.start = time.perf_counter()
        self.tty = self.stream.isatty()

    def line(self) -> str:
        return (f"{self.done}/{self.total} {self.what} ({self.cached} cached), "
                f"{time.perf_counter() - self.start:.1f} s")

    def __call__(self, cached: bool = False) -> None:
        self.done += 1
        self.cached += bool(cached)
        if self.tty:
            self.stream.write("\r" + self.line())
            self.stream.flush()

    def close(self) -> None:
        self.stream.write(("\r" if self.tty else "") + self.line() + "\n")
        self.stream.flush()
