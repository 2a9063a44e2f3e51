"""DMuon's health where a Megatron user already looks: TensorBoard and W&B, through Megatron's writers.

Every name is under ``dmuon/`` and documented in ``METRICS`` (docs/metrics.md prints the table). The
step records only what the host already holds (its counters) and, on CUDA, two events around each
optimizer step, which do not wait for the device: nothing inside the step reads a device value back.
At the log interval ``DMuonMetrics.values`` reads the events once and gathers every rank's step time
in one collective (the log line's loss was read back already), and ``write_values`` hands them to a
TensorBoard ``SummaryWriter`` (``add_scalar``) and a W&B run (``log``), as Megatron-LM's
``training_log`` writes its own.

Where they come from: the main job (``--tensorboard-dir``, ``--wandb-project``: train/loop.py) and the
Megatron-LM hook (megatron_lm.py wraps Megatron-LM's ``training_log``; its writers are Megatron's
``get_tensorboard_writer()`` / ``get_wandb_writer()``), both with the same names.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Dict, List, Optional

import torch

PREFIX = "dmuon/"


@dataclasses.dataclass(frozen=True)
class Metric:
    name: str
    unit: str
    rank: str  # whose value the writer gets
    what: str


METRICS = (
    Metric("dmuon/optimizer_ms", "ms", "the writing rank", "the optimizer step (momentum, NS, AdamW, apply; not the "
           "overlapped NS after it), the mean over the log interval"),
    Metric("dmuon/optimizer_ms_slowest_rank", "ms", "the slowest rank", "the same, of the slowest rank: what the step "
           "waits for"),
    Metric("dmuon/optimizer_ms_mean_rank", "ms", "the mean over the ranks", "the same, averaged over the ranks"),
    Metric("dmuon/rank_imbalance", "ratio", "all ranks", "slowest / mean: how well the owner plan balances the ranks "
           "(1 is perfect)"),
    Metric("dmuon/ns_matrices", "matrices per step", "the writing rank", "Muon matrices this rank orthogonalized in "
           "its last step (its NS homes and owned matrices)"),
    Metric("dmuon/ns_fp32_retries", "matrices per interval", "summed over the ranks", "NS outputs with NaN/Inf, "
           "recomputed in float32"),
    Metric("dmuon/ns_check_recomputed", "matrices per interval", "summed over the ranks", "NS outputs the online "
           "check (--dmuon-ns-check-interval) found out of bounds and recomputed exactly"),
    Metric("dmuon/ns_check_worst", "top-eig(O^T O - I)", "the worst rank", "the online check's worst estimate of "
           "the interval's check steps (absent from an interval without one)"),
    Metric("dmuon/skipped_iterations", "iterations", "every rank (equal)", "steps skipped for a non-finite "
           "gradient, since the start"),
    Metric("dmuon/publish_bytes", "bytes per step", "the writing rank", "what the param all-gather sends to "
           "publish the step (ring, this rank)"),
    Metric("dmuon/split_exchange_bytes", "bytes per step", "the writing rank", "what the split layout's exchange "
           "sent in the last step (pieces to their NS homes, directions back; under --dmuon-overlap-step on, "
           "whose ways back run in the next forward: the step before; 0 under whole matrices)"),
)
NAMES = tuple(m.name for m in METRICS)


class DMuonMetrics:
    """Per log interval, the metrics of one DMuon optimizer (a ``DMuonChainedOptimizer``)."""

    def __init__(self, chained, bytes_per_step: dict):
        """``bytes_per_step``: optimizer.comm_bytes_per_step of the model chunks (fixed by the plan)."""
        self.chained = chained
        self._static = {"dmuon/publish_bytes": bytes_per_step["publish_bytes"]}
        self._events: List[tuple] = []  # (start, end) per step of the interval: CUDA events, or host seconds
        self._open = None
        self._counted = self._counters()

    def _parts(self):
        return [p.optimizer for p in self.chained.chained_optimizers if hasattr(p.optimizer, "ns_check")]

    def _counters(self) -> Dict[str, float]:
        parts = self._parts()
        return {"retries": sum(p.stats["ns_fp32_retries_total"] for p in parts),
                "recomputed": sum(p.ns_check.recomputed_total for p in parts)}

    def begin_step(self) -> None:
        """Just before the step: an event on the current stream (CUDA: the device is not waited for)."""
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            self._open = start
        else:
            self._open = time.perf_counter()

    def end_step(self) -> None:
        if self._open is None:
            return
        if isinstance(self._open, float):
            self._events.append((self._open, time.perf_counter()))
        else:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((self._open, end))
        self._open = None
        worst = [p.ns_check.last["worst"] for p in self._parts() if p.ns_check.last]
        if worst:
            self._worst = max(worst + [getattr(self, "_worst", float("-inf"))])

    def values(self, group=None) -> Dict[str, float]:
        """The interval's values (read once here: the events, one all-gather of the step times and counts
        over ``group``, default the world); starts the next interval."""
        ms = []
        for start, end in self._events:
            ms.append((end - start) * 1e3 if isinstance(start, float) else (end.synchronize() or start.elapsed_time(end)))
        mine = sum(ms) / len(ms) if ms else 0.0
        counters = self._counters()
        delta = {k: counters[k] - self._counted[k] for k in counters}
        self._counted, self._events = counters, []
        worst = getattr(self, "_worst", None)
        self._worst = float("-inf")
        local = torch.tensor([mine, delta["retries"], delta["recomputed"],
                              worst if worst is not None and worst > float("-inf") else float("-inf")],
                             dtype=torch.float64)
        if torch.distributed.is_initialized():
            gathered = [torch.zeros_like(local) for _ in range(torch.distributed.get_world_size(group))]
            device = "cuda" if torch.distributed.get_backend(group) == "nccl" else "cpu"
            gathered = [g.to(device) for g in gathered]
            torch.distributed.all_gather(gathered, local.to(device), group=group)
            table = torch.stack([g.cpu() for g in gathered])
        else:
            table = local.unsqueeze(0)
        step_ms = table[:, 0]
        out = {"dmuon/optimizer_ms": mine,
               "dmuon/optimizer_ms_slowest_rank": float(step_ms.max()),
               "dmuon/optimizer_ms_mean_rank": float(step_ms.mean()),
               "dmuon/rank_imbalance": float(step_ms.max() / step_ms.mean()) if float(step_ms.mean()) > 0 else 1.0,
               "dmuon/ns_matrices": float(sum(p.stats["ns_matrices"] for p in self._parts())),
               "dmuon/ns_fp32_retries": float(table[:, 1].sum()),
               "dmuon/ns_check_recomputed": float(table[:, 2].sum()),
               "dmuon/skipped_iterations": float(self.chained.skipped_iterations),
               # counted as sent (host ints: the 16-bit way back where the NS returns 16 bits, runtime/dp_exchange.py)
               "dmuon/split_exchange_bytes": float(sum(p.stats["dp_bytes"] for p in self._parts())), **self._static}
        if float(table[:, 3].max()) > float("-inf"):
            out["dmuon/ns_check_worst"] = float(table[:, 3].max())
        return out



def write_values(iteration: int, values: Dict[str, float], tensorboard=None, wandb=None) -> None:
    """``values`` at ``iteration`` into a TensorBoard writer (``add_scalar``) and a W&B run (``log``),
    either of which may be None."""
    if tensorboard is not None:
        for name, value in values.items():
            tensorboard.add_scalar(name, value, iteration)
        tensorboard.flush()
    if wandb is not None:
        wandb.log(dict(values), iteration)


def tensorboard_writer(log_dir: str):
    """A TensorBoard ``SummaryWriter`` on ``log_dir`` (torch's; the ``tensorboard`` package is needed)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise ValueError(f"--tensorboard-dir needs the tensorboard package ({e}): pip install tensorboard") from None
    return SummaryWriter(log_dir=log_dir, max_queue=1000)


def wandb_run(project: str, name: Optional[str], save_dir: Optional[str], config: dict):
    """A W&B run (offline unless WANDB_MODE says otherwise and an API key is set: the run files stay in
    ``save_dir`` and ``wandb sync`` uploads them later)."""
    import os

    try:
        import wandb
    except ImportError as e:
        raise ValueError(f"--wandb-project needs the wandb package ({e}): pip install wandb") from None
    mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
    return wandb.init(project=project, name=name, dir=save_dir, config=config, mode=mode)
