"""DMuon's messages in Megatron-Bridge's terms (no Bridge import: the launcher and CI use it)."""
from __future__ import annotations

import re


def bridge_names(message: str) -> str:
    """A DMuon error message in Bridge's terms: ``--muon-x-y`` -> ``optimizer.muon_x_y``,
    ``--dmuon-x-y`` -> ``dmuon_options['x_y']``, ``--use-distributed-optimizer`` -> the two fields."""
    message = re.sub(r"--dmuon-([a-z0-9-]+)", lambda m: f"dmuon_options['{m.group(1).replace('-', '_')}']", message)
    message = re.sub(r"--muon-([a-z0-9-]+)", lambda m: f"optimizer.muon_{m.group(1).replace('-', '_')}", message)
    return message.replace("--use-distributed-optimizer",
                           "ddp.use_distributed_optimizer and optimizer.use_distributed_optimizer")
