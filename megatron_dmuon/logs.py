"""The package's log lines (``logging.getLogger("megatron_dmuon...")``) on a stream, one message a
line: what the project's trainer calls at start-up. Megatron-LM configures logging itself (INFO on
the root logger), so under its scripts the lines appear without this."""
from __future__ import annotations

import logging
import sys

_handler = None  # the one handler log_to added


def log_to(stream=None, level: int = logging.INFO) -> None:
    """Send the package's records of ``level`` and above to ``stream`` (default: stdout); once."""
    global _handler
    logger = logging.getLogger("megatron_dmuon")
    if _handler is None:
        _handler = logging.StreamHandler(stream or sys.stdout)
        _handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(_handler)
    logger.setLevel(level)
