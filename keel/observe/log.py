"""keel's log lines (dataset counts, warnings, resume notices) reach the user from Python too."""

import logging
import re
import sys
import threading
from contextlib import contextmanager

# what differs between repeats of a warning
NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?")


def ensure_console_logging() -> None:
    """Show keel's INFO lines on stderr unless the application configured logging itself."""
    logger = logging.getLogger("keel")
    if logger.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("keel: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)


class SaidOnce(logging.Filter):
    """A warning that repeats is printed once, saying so, then counted: a run's 30th "responses hit
    max_response_length" buries the lines around it and tells nothing the first did not.

    Warnings are the same when their `kind` is (`extra={"kind": ...}`), else when their words are,
    numbers aside ("step 3: 97% of ..." repeats "step 1: 92% of ...")."""

    def __init__(self):
        super().__init__()
        self.counts: dict[str, int] = {}
        self.first: dict[str, str] = {}
        # scorer and tool threads warn too
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        message = record.getMessage()
        key = getattr(record, "kind", None) or NUMBER.sub("#", message)
        with self._lock:
            self.counts[key] = self.counts.get(key, 0) + 1
            if self.counts[key] > 1:
                return False
            self.first[key] = message
        record.msg, record.args = f"{message} (said once; repeats are counted)", ()
        return True

    def summary(self) -> list[str]:
        """A line per warning that repeated."""
        return [
            f"this warning came {n} times, printed once: {self.first[key]}"
            for key, n in self.counts.items()
            if n > 1
        ]


@contextmanager
# one logger per name
def warnings_said_once(logger: logging.Logger = logging.getLogger("keel")):  # noqa: B008
    """Within the block, `logger`'s repeated warnings are counted instead of printed; at its end, a
    line per warning that repeated."""
    said_once = SaidOnce()
    logger.addFilter(said_once)
    try:
        yield said_once
    finally:
        logger.removeFilter(said_once)
        for line in said_once.summary():
            logger.info(line)
