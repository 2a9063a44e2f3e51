"""DMuon's messages in Megatron-Bridge's terms (no Bridge import: the Bridge launcher and CI use it)."""
from __future__ import annotations

import re
from typing import Dict, Optional


def bridge_names(message: str, sections: Optional[Dict[str, str]] = None) -> str:
    """A DMuon error message in Bridge's terms: ``--muon-x-y`` -> ``optimizer.muon_x_y``,
    ``--dmuon-x-y`` -> ``dmuon_options['x_y']``, ``--use-distributed-optimizer`` -> the two fields,
    and any other ``--x-y`` whose field ``x_y`` ``sections`` places ({field: 'ddp' | 'optimizer' |
    'model'}) -> ``section.x_y``."""
    message = re.sub(r"--dmuon-([a-z0-9-]+)", lambda m: f"dmuon_options['{m.group(1).replace('-', '_')}']", message)
    message = re.sub(r"--muon-([a-z0-9-]+)", lambda m: f"optimizer.muon_{m.group(1).replace('-', '_')}", message)
    message = message.replace("--use-distributed-optimizer",
                              "ddp.use_distributed_optimizer and optimizer.use_distributed_optimizer")
    if sections:
        def field(m):
            name = m.group(1).replace("-", "_")
            return f"{sections[name]}.{name}" if name in sections else m.group(0)

        message = re.sub(r"--([a-z][a-z0-9-]+)", field, message)
    return message
