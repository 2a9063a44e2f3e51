"""What each overlapped-step mode (``MuonSettings.overlap_step``) means, in the one place that compares
its names.

Every other module asks an `OverlapMode` (``OverlapMode(settings.overlap_step).overlaps``) instead
of comparing the strings, so a mode's meaning cannot drift between the owner step, the Megatron
glue, the start-up checks and the planner's simulation (tests/test_layers.py keeps it so). It lives
in planning/ because ``dmuon plan --overlap-step`` asks it too, and planning/ imports no runtime/.
"""
from __future__ import annotations

import dataclasses
from typing import Literal, get_args

# 'off': the owner step as ever, one batched NS per stack shape inside optimizer.step();
# 'on': the Muon work cut per need group (MatrixInfo.need), each group's NS launched by the step and
#   finished when the next forward first needs its params (runtime/overlapped_step.OverlappedStep);
# 'sync': the same cut stacks and arithmetic, finished inside the step (for checking 'on' bit for bit);
# 'backward': 'on', and each group's momentum and NS launched during the last micro-batch's backward,
#   as soon as its grads are reduced, unclipped: a step whose clipping fires redoes them
OverlapStep = Literal["off", "on", "sync", "backward"]
OVERLAP_STEP_MODES: tuple = get_args(OverlapStep)


@dataclasses.dataclass(frozen=True)
class OverlapMode:
    name: str = "off"

    def __post_init__(self):
        if self.name not in OVERLAP_STEP_MODES:
            raise ValueError(f"overlap step mode {self.name!r} unknown; valid: {', '.join(OVERLAP_STEP_MODES)}")

    @property
    def cuts_per_need_group(self) -> bool:
        """The Muon work runs as need groups (the OverlappedStep): every mode but 'off'."""
        return self.name != "off"

    @property
    def overlaps(self) -> bool:
        """The NS runs outside optimizer.step(), hidden behind the next forward ('on', 'backward')."""
        return self.name in ("on", "backward")

    @property
    def starts_in_backward(self) -> bool:
        """Each group's momentum and NS start in the backward that reduces its grads ('backward')."""
        return self.name == "backward"

    @property
    def finishes_in_step(self) -> bool:
        """The need groups are finished inside optimizer.step() ('sync')."""
        return self.name == "sync"
