"""A progress bar for long runs: tqdm when it is installed, else a plain line on stderr.

fastpipe does not depend on tqdm; ``progress(total)`` picks what is there. Both forms take
``update(status)`` once per step and ``close()`` at the end, and ``write(line)`` prints a line
without breaking the bar.
"""
from __future__ import annotations

import importlib.util
import sys
import time
from typing import Any, Optional, TextIO


class LineProgress:
    """``steps 12/40 [status]`` on stderr, rewritten in place on a terminal; silent when stderr
    is a file or pipe (a log), where the caller's own ``write`` lines tell the progress."""

    def __init__(self, total: int, desc: str = "steps", stream: Optional[TextIO] = None) -> None:
        self.total, self.desc, self.count = total, desc, 0
        self.stream = stream if stream is not None else sys.stderr
        self.live = bool(getattr(self.stream, "isatty", lambda: False)())
        self.start = time.perf_counter()

    def update(self, status: str = "") -> None:
        """One more step done; ``status`` (e.g. the loss) is shown beside the count."""
        self.count += 1
        if not self.live:
            return
        elapsed = time.perf_counter() - self.start
        line = f"{self.desc} {self.count}/{self.total} [{elapsed:.1f}s] {status}".rstrip()
        self.stream.write(f"\r{line}\033[K")
        self.stream.flush()

    def write(self, line: str) -> None:
        """Print ``line`` on stdout (on its own line, above the bar on a terminal)."""
        if self.live and self.count:
            self.stream.write("\r\033[K")
        print(line, flush=True)

    def close(self) -> None:
        if self.live and self.count:
            self.stream.write("\n")
            self.stream.flush()


class TqdmProgress:
    """The same interface over ``tqdm``."""

    def __init__(self, total: int, desc: str = "steps") -> None:
        from tqdm import tqdm
        self._tqdm = tqdm
        self.bar = tqdm(total=total, desc=desc, unit="step", file=sys.stderr)

    def update(self, status: str = "") -> None:
        self.bar.set_postfix_str(status, refresh=False)
        self.bar.update(1)

    def write(self, line: str) -> None:
        self._tqdm.write(line, file=sys.stdout)

    def close(self) -> None:
        self.bar.close()


def progress(total: int, desc: str = "steps", *, use_tqdm: Optional[bool] = None) -> Any:
    """A progress bar over ``total`` steps: tqdm if importable (or if ``use_tqdm``), else a
    ``LineProgress``."""
    if use_tqdm is None:
        use_tqdm = importlib.util.find_spec("tqdm") is not None
    return TqdmProgress(total, desc) if use_tqdm else LineProgress(total, desc)
