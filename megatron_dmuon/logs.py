"""The package's log lines (``logging.getLogger("megatron_dmuon...")``) on a stream, one message a
line: what the project's trainer calls at start-up. Megatron-LM configures logging itself (INFO on
the root logger), so under its scripts the lines appear without this."""
from __future__ import annotations

import logging
import sys


def log_to(stream=None, level: int = logging.INFO) -> None:
    """Send the package's records of ``level`` and above to ``stream`` (default: stdout); once."""
    logger = logging.getLogger("megatron_dmuon")
    if not any(getattr(h, "dmuon_stream", False) for h in logger.handlers):
        handler = logging.StreamHandler(stream or sys.stdout)
        handler.setFormatter(logging.Formatter("%(message)s"))
        handler.dmuon_stream = True
        logger.addHandler(handler)
    logger.setLevel(level)
