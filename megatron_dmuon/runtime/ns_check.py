"""Online NS quality: every N steps each owner checks its NS outputs and repairs the bad ones.

A half-precision NS can fail on the matrices a run really produces (low-rank momenta with a heavy
tail) while passing every test on Gaussian ones: bf16 Gram NS without a restart returned singular
values of 41-185 on real momenta, and training diverged (docs/quality.md). So every
``MuonSettings.ns_check_interval`` optimizer steps, per shape group, the owner estimates for each
output O the top eigenvalue of ``OᵀO − I`` by random probes (``algorithms.ns_metrics.
orthogonality_overshoot``: a few matrix-vector products, no SVD) and recomputes every output above
``MuonSettings.ns_check_limit`` with the exact float32 standard NS of the same schedule. The
counts and the worst matrix go to the optimizer's log (``megatron.optimizer``), with a warning
the first time anything is recomputed.

The check is a function of the step count and the data only (probes drawn from a generator seeded
by the step), so every run, and a resumed one, checks and repairs the same matrices.
"""
from __future__ import annotations

from typing import Callable, List, Optional

import torch

from ..algorithms.ns_metrics import orthogonality_overshoot


class NSQualityCheck:
    """Step counter, cadence and findings of the online NS check of one owner optimizer."""

    def __init__(self, settings, exact: Callable[[torch.Tensor], torch.Tensor]):
        self.settings = settings
        self.exact = exact
        self.steps = 0  # optimizer steps applied (a checkpoint restores it: megatron/checkpoint/optimizer_state.py)
        self.recomputed_total = 0
        self.last: Optional[dict] = None  # this step's findings, when it was a check step

    def begin_step(self) -> None:
        self.steps += 1
        self.last = None

    def due(self) -> bool:
        interval = self.settings.ns_check_interval
        return bool(interval) and self.steps % interval == 0

    @torch.no_grad()
    def check(self, outputs: List[torch.Tensor], stacks: List[torch.Tensor], names: List[List[str]]) -> List[torch.Tensor]:
        """Check every output (one host sync), recompute the ones out of bounds in place, and
        record the worst estimate of this step. Returns the outputs."""
        found = self.last or {"step": self.steps, "worst": float("-inf"), "worst_name": None, "worst_limit": None,
                              "checked": 0, "recomputed": 0}
        generator = torch.Generator().manual_seed(1_000_003 * self.steps + 17)
        outputs = list(outputs)
        for k, (out, inputs, slot_names) in enumerate(zip(outputs, stacks, names)):
            flat = out.reshape(-1, out.size(-2), out.size(-1))
            estimate = orthogonality_overshoot(flat, generator=generator).tolist()
            limit = self.settings.ns_check_limit(out.size(-2), out.size(-1))
            found["checked"] += len(estimate)
            for i, value in enumerate(estimate):
                if value > found["worst"]:
                    found.update(worst=value, worst_name=slot_names[i] if i < len(slot_names) else "?",
                                 worst_limit=limit)
            bad = [i for i, value in enumerate(estimate) if not value <= limit]
            if bad:
                index = torch.tensor(bad, device=flat.device)
                source = inputs.reshape(-1, inputs.size(-2), inputs.size(-1))[index]
                flat[index] = self.exact(source).to(flat.dtype)
                outputs[k] = flat.view(out.shape)  # (a copy when ``out`` was not contiguous)
                found["recomputed"] += len(bad)
                self.recomputed_total += len(bad)
        self.last = found
        return outputs
