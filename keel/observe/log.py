"""keel's log lines (dataset counts, warnings, resume notices) reach the user from Python too."""

import logging
import sys


def ensure_console_logging() -> None:
    """Show keel's INFO lines on stderr unless the application configured logging itself."""
    logger = logging.getLogger("keel")
    if logger.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("keel: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
