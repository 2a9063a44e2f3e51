"""The owner step: Muon on the matrices this rank owns (batched by shape), AdamW elsewhere.

`OwnerMuonAdamW` is the *inner* optimizer of the DMuon DistributedOptimizer. Megatron hands it
1-D fp32 main-param shards; the owner-aligned layout guarantees that every Muon matrix arrives
whole on exactly one rank, so its shard can be viewed as the full matrix. Matrices (or split
pieces: QKV blocks, heads) of equal shape are stacked and orthogonalized in ONE batched NS call.
It subclasses torch.optim.AdamW so element-wise params take torch's exact AdamW code path.
"""
from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import Callable, Collection, Dict, List, Optional, Sequence

import torch
from torch.profiler import record_function

from ..algorithms.muon import muon_apply_, muon_direction, muon_direction_scale, muon_lr_scale
from ..kernels import GraphedGroups, orthogonalize_groups
from ..kernels.fused_muon import muon_apply_fast_, muon_momentum_fast_  # the torch ops where they cannot fuse
from ..kernels.metrics import NONFINITE_METRICS, retry_nonfinite_stacks
from ..planning.overlap_mode import OverlapMode
from ..planning.split_layout import narrow_directions
from .ns_check import NSQualityCheck
from .ns_stacks import StackJob, StackPlan
from .muon_settings import ADAPTIVE_SCHEDULE, NS_CHECK_MARGIN, NS_LAUNCH_MODES, MuonSettings  # noqa: F401
from .overlapped_step import OverlappedStep, OwnerOverlap
from .row_update_step import row_update_step
from .dp_exchange import DPExchange
from .team_ns import team_directions
from .narrow_directions import NarrowDecoder, encode_direction
from .matrix_info import MatrixInfo, with_ns_choices  # noqa: F401 (the owner step's public names)
from .ns_run import default_orthogonalizer, fp32_orthogonalizer, run_ns  # noqa: F401 (ditto)
from .tp_exchange import TPExchange


class OwnerMuonAdamW(OwnerOverlap, torch.optim.AdamW):
    """Param groups with ``use_muon=True`` get Muon; the others get torch's AdamW.

    With ``tp_group`` (tensor parallelism) every Muon param is this rank's shard of a matrix;
    updates go to each matrix's TP owner and directions come back (``runtime.tp_exchange``).
    With overlap step 'on' (``MuonSettings.overlap_step``) the Muon work is cut per need group and finished apart from
    ``step()`` (runtime/overlapped_step.py: ``OwnerOverlap``'s methods)."""

    # the split layout sends directions back as their NS outputs' 16-bit bits where the NS returns its
    # compute dtype (CUDA: _narrow_directions); True / False: always / never (tests)
    narrow_directions: Optional[bool] = None

    def __init__(self, params, *, lr, weight_decay, betas=(0.9, 0.999), eps=1e-8,
                 muon: Optional[MuonSettings] = None, orthogonalizer=None, tp_group=None, dp_group=None,
                 fused_adamw: Optional[bool] = None):
        # fused_adamw: torch's one-kernel AdamW for the element-wise params (the same update in
        # one pass instead of ~8 foreach passes; the rounding of a fused kernel, as Transformer
        # Engine's FusedAdam gives Megatron). None: on CUDA, where it exists.
        params = list(params)
        if fused_adamw is None:
            fused_adamw = all(p.is_cuda for g in params for p in (g["params"] if isinstance(g, dict) else [g]))
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=fused_adamw or None)
        self.muon = muon or MuonSettings()  # (checked where the config is built: megatron/config.py)
        if orthogonalizer is not None and self.muon.ns_launch != "eager":
            raise ValueError(
                f"dmuon ns_launch={self.muon.ns_launch!r} runs the kernels' own group launcher; it cannot "
                "wrap a custom orthogonalizer: pass ns_launch='eager' with it"
            )
        self.orthogonalizer = orthogonalizer  # None: run_ns with each stack's NSChoice
        self._fp32_orthogonalizer = fp32_orthogonalizer(self.muon)
        self.ns_check = NSQualityCheck(self.muon, fp32_orthogonalizer(self.muon, method="standard"))
        self.tp = TPExchange(tp_group)
        self.dp = DPExchange(dp_group)  # the split layout's pieces and NS homes (runtime/dp_exchange.py)
        # split layout: the matrices whose NS home is this rank but of which it holds no piece, and every
        # split matrix of this optimizer (the exchange may route pieces of others through this rank)
        self.homed: Dict[str, MatrixInfo] = {}
        self.split_matrices: Dict[str, MatrixInfo] = {}
        self.overlap_mode = OverlapMode(self.muon.overlap_step)
        if self.tp.size > 1 and (self.muon.rule.by_rows or self.overlap_mode.cuts_per_need_group):  # (refused at start-up)
            raise ValueError(f"DMuon: update={self.muon.update!r} with overlap_step={self.muon.overlap_step!r} needs "
                             f"each matrix whole on its owner, not a TP group of {self.tp.size}")
        # the overlapped step (runtime/overlapped_step.py): the runtime of its need groups in flight,
        # and what each group's fp32 masters are handed to once applied (the DistributedOptimizer's
        # copy to the model params; None: nothing to copy)
        self._overlapped = OverlappedStep(self.overlap_mode)
        self.on_applied: Optional[Callable[[list], None]] = None
        self._graphs: Dict[tuple, object] = {}  # ns_launch='graph': one GraphedGroups per stack-shape set
        self.matrix_info: Dict[torch.Tensor, MatrixInfo] = {}
        # ns_matrices / ns_calls / ns_fp32_retries of the last step; ns_matrices_total, ns_fp32_retries_total
        self.stats = defaultdict(int)
        # '<rows>x<cols>' -> the NS path its stacks ran (NSChoice.label; 'custom' for an
        # orthogonalizer passed in), recorded on first use: shows what 'auto' chose on this device
        self.ns_paths: Dict[str, str] = {}
        # gradient clipping handed to the step (DMuonChainedOptimizer): the next step() multiplies
        # every grad by it first, as Megatron's clip would (same roundings), but inside the Muon
        # momentum pass instead of a pass of its own; consumed by that step
        self.grad_scale: Optional[float] = None

    def register_matrix(self, main_param: torch.Tensor, info: MatrixInfo) -> None:
        held = info.held_shape
        if main_param.numel() != torch.Size(held).numel():
            raise RuntimeError(
                f"DMuon: rank holds {main_param.numel()} elements of matrix {info.name} {tuple(info.local_shape)}, "
                f"its plan gives it {tuple(held)}: the layout must deliver whole matrices, TP shards or the split "
                "layout's pieces"
            )
        if any(i.name == info.name for i in self.matrix_info.values()) or info.name in self.homed:
            raise ValueError(f"DMuon: matrix name {info.name!r} registered twice")
        self._check_ns_choice(info)
        if (info.dp_split is None) != (info.dp_piece is None) or (
                info.dp_split is not None and info.dp_split.piece_of(self.dp.rank) != info.dp_piece):
            raise ValueError(f"DMuon: matrix {info.name!r}: its piece {info.dp_piece} is not the one its split "
                             f"layout gives DP rank {self.dp.rank}")
        self.matrix_info[main_param] = info

    def register_home(self, info: MatrixInfo) -> None:
        """A split-layout matrix whose NS home is this rank though its shards hold none of it: the home
        receives every piece of its update, orthogonalizes it and sends the pieces of the direction back."""
        homes = {h for h, _, _ in info.dp_split.homes()[1]} if info.dp_split is not None else set()
        if self.dp.rank not in homes or info.dp_piece is not None:
            raise ValueError(f"DMuon: {info.name!r} is not a split-layout matrix homed on DP rank {self.dp.rank} "
                             "without a piece here")
        if info.name in self.homed or any(i.name == info.name for i in self.matrix_info.values()):
            raise ValueError(f"DMuon: matrix name {info.name!r} registered twice")
        self._check_ns_choice(info)
        self.homed[info.name] = info

    def register_split_matrices(self, infos: Sequence[MatrixInfo]) -> None:
        """Every split-layout matrix of this optimizer, whoever holds it: the exchange's transfers are
        derived from all of them on every rank (a piece bound for another node passes through a node-mate
        of its home)."""
        for info in infos:
            if info.dp_split is None:
                raise ValueError(f"DMuon: {info.name!r} is not a split-layout matrix")
            self.split_matrices[info.name] = info

    @staticmethod
    def _check_ns_choice(info: MatrixInfo) -> None:
        if not info.ns:
            raise ValueError(f"DMuon: matrix {info.name!r} has no NS choice (MatrixInfo.ns): build its info from "
                             "its plan record (MatrixInfo.from_record with planning.ns_choice.plan_ns_choices), "
                             "or decide it with runtime.owner_step.with_ns_choices")

    @property
    def splits_matrices(self) -> bool:
        """Whether the split layout cuts any matrix of this optimizer (the general exchange step runs)."""
        return bool(self.split_matrices or self.homed) or any(i.dp_split is not None for i in self.matrix_info.values())

    def _momentum_dtype(self, p: torch.Tensor) -> torch.dtype:
        """The stored momentum's dtype: bf16 when asked, else the master's (fp32; float64 in the
        float64 exactness tests)."""
        return torch.bfloat16 if self.muon.momentum_dtype == torch.bfloat16 else p.dtype

    def holds_momentum(self, info: MatrixInfo) -> bool:
        """Every rank keeps momentum for its shard; a TP-replicated matrix's only on its owner."""
        return info.partition_dim is not None or info.tp_owner == self.tp.rank

    @torch.no_grad()
    def init_state(self) -> None:
        """Create every state tensor now, for every param (not lazily at the first grad): all
        ranks then hold the same state keys from the start, whatever gradients they see (an expert
        without tokens, a TP rank that does not hold a replicated matrix's momentum), which
        checkpoints need. Values are what the first step would create: zeros and step 0."""
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if group.get("use_muon", False):
                    state.setdefault("momentum_buffer", torch.zeros_like(p, dtype=self._momentum_dtype(p)))
                    if self.muon.rule.by_rows and p in self.matrix_info:  # one second moment per row
                        state.setdefault("row_variance", p.new_zeros(self.matrix_info[p].shape[0]))
                elif len(state) == 0:  # exactly torch.optim.AdamW's lazy initialization
                    scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
                    state["step"] = (torch.zeros((), dtype=torch.float32, device=p.device)
                                     if group.get("capturable") or group.get("fused")
                                     else torch.tensor(0.0, dtype=scalar))
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    if group.get("amsgrad"):
                        state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def adam_steps(self) -> set:
        """The distinct AdamW step counts of this rank's element-wise params (one value when every
        param stepped together, as under Megatron's DistributedOptimizer)."""
        return {float(self.state[p]["step"]) for g in self.param_groups if not g.get("use_muon", False)
                for p in g["params"] if "step" in self.state.get(p, {})}

    def set_adam_step(self, step: float) -> None:
        for g in self.param_groups:
            if not g.get("use_muon", False):
                for p in g["params"]:
                    if "step" in self.state.get(p, {}):
                        self.state[p]["step"].fill_(step)

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        grad_scale, self.grad_scale = self.grad_scale, None
        self._begin_overlapped_step(grad_scale)  # what the last forward left in flight, finished
        self.ns_check.begin_step()
        all_groups = self.param_groups
        adam_groups = [g for g in all_groups if not g.get("use_muon", False)]
        muon_groups = [g for g in all_groups if g.get("use_muon", False)]
        adam_params = [p for g in adam_groups for p in g["params"] if p.grad is not None]
        # On CUDA the element-wise AdamW (memory-bound) runs on a side stream while the Muon step's
        # NS (compute-bound) runs on the current one: disjoint params, so the result is the same.
        side = self._side_stream(adam_params[0].device) if adam_params and adam_params[0].is_cuda and any(
            g["params"] for g in muon_groups) else None
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(side.device))  # grads (and clipping) are ready
        if adam_params:
            try:
                self.param_groups = adam_groups
                with record_function("dmuon.adamw"), (torch.cuda.stream(side) if side else contextlib.nullcontext()):
                    if grad_scale is not None:  # Megatron's clip: dst.copy_(src * coefficient), same bits
                        torch._foreach_mul_([p.grad for p in adam_params], grad_scale)
                    self._adam_steps_on_param_devices(adam_groups)
                    super().step()
            finally:
                self.param_groups = all_groups
        self._muon_step(muon_groups, grad_scale)
        if side is not None:
            torch.cuda.current_stream(side.device).wait_stream(side)
        return loss

    def _adam_steps_on_param_devices(self, groups) -> None:
        """The fused AdamW kernel reads its step counters on the params' device; a checkpoint
        loaded by DMuon's own code (not torch's load_state_dict, which moves them) may hold them
        on the CPU."""
        for g in groups:
            if g.get("fused"):
                for p in g["params"]:
                    step = self.state.get(p, {}).get("step")
                    if step is not None and step.device != p.device:
                        self.state[p]["step"] = step.to(device=p.device, dtype=torch.float32)

    def _side_stream(self, device) -> "torch.cuda.Stream":
        streams = self.__dict__.setdefault("_adam_streams", {})
        if device not in streams:
            streams[device] = torch.cuda.Stream(device=device)
        return streams[device]

    def _muon_step(self, groups, grad_scale: Optional[float] = None) -> None:
        s = self.muon
        entries = []
        for group in groups:
            for p in group["params"]:
                info = self.matrix_info.get(p)
                if info is None:
                    raise RuntimeError("DMuon: a Muon param has no registered matrix shape")
                # without TP a param with no grad is skipped (torch semantics); under TP every rank
                # of the group must step the same matrices, and a split matrix's home waits for every
                # piece, so a missing grad counts as zero
                if p.grad is not None or self.tp.size > 1 or info.dp_split is not None:
                    entries.append((p, group, info))
        entries.sort(key=lambda e: e[2].name)  # the same order on every TP rank
        if self._overlapped.started_early():  # 'backward': launched during the backward; the step launches the rest
            entries = self._overlapped.take_early(entries)
            if not entries:
                self.stats["ns_matrices_total"] += self.stats["ns_matrices"]
                return None
        else:
            self.stats["ns_calls"] = self.stats["ns_fp32_retries"] = self.stats["ns_matrices"] = 0
        if not s.rule.by_rows and self.tp.size == 1 and not self.splits_matrices:
            if self.overlap_mode.cuts_per_need_group:
                return self._launch_overlapped(entries, grad_scale)
            return self._local_step(entries, grad_scale)  # clipping folded into the momentum pass
        if grad_scale is not None:
            torch._foreach_mul_([p.grad for p, _, _ in entries if p.grad is not None], grad_scale)
        if s.rule.by_rows:
            return row_update_step(self, entries)
        if self.overlap_mode.cuts_per_need_group:  # the split layout (TP is refused above)
            return self._launch_overlapped_split(entries)
        return self._exchange_step(entries)

    def _exchange_step(self, entries) -> None:
        """Under TP or the split layout: each matrix's update travels to where its NS runs and the
        direction comes back to every shard and piece. Split layout (runtime.dp_exchange): the pieces
        go to the matrix's NS home over DP first; then, under TP, the home's TP shards go to the TP
        owner (or into distributed Gram NS, runtime.tp_exchange); directions return the same way."""
        like = self._master_like(entries)
        with record_function("dmuon.momentum"):
            updates = self._momentum_updates(entries)  # of what this rank holds (its piece, its TP shard)
        self.tp.bytes_sent = self.dp.bytes_sent = 0
        self.stats["ns_matrices"] = 0
        split = self.split_of(entries)
        work = {info.name: info for _, _, info in entries if info.dp_split is None}
        work_updates = {n: u for n, u in updates.items() if n in work}
        teams = {}  # the team-shared matrices with a block homed here (their NS runs with the team's other homes)
        if split:
            work_updates.update(self.split_to_homes(split, updates, like))
            work.update({n: i for n, i in split.items() if i.dp_split.home == self.dp.rank and not i.dp_split.team})
            teams = {n: i for n, i in split.items() if i.dp_split.team and n in work_updates}
        infos = [work[n] for n in sorted(work)]  # the same order on every TP rank of this DP index
        directions = self._distributed_gram_step([i for i in infos if i.tp_method == "distributed_gram"], work_updates,
                                                 like)
        directions.update(team_directions(self, [teams[n] for n in sorted(teams)], work_updates, like))
        outputs: Dict[str, list] = {}  # the NS outputs of every matrix orthogonalized here
        narrow = set(self._narrow_directions(split.values(), like)) if split else set()
        directions.update(self._gather_step([i for i in infos if i.tp_method != "distributed_gram"], work_updates,
                                            like, outputs, narrow))
        if split:
            directions.update(self.split_from_homes(split, outputs, directions, narrow, like))
        self.apply_directions(entries, directions)
        self.stats["ns_matrices_total"] += self.stats["ns_matrices"]
        self.stats["tp_bytes"] = self.tp.bytes_sent
        self.stats["dp_bytes"] = self.dp.bytes_sent

    def split_of(self, entries) -> Dict[str, MatrixInfo]:
        """Every split matrix of this optimizer, held, homed or passing by (the exchange may route
        pieces of others through this rank), with this step's ``entries``' own views of theirs."""
        split = dict(self.split_matrices)
        split.update({info.name: info for _, _, info in entries if info.dp_split is not None})
        split.update(self.homed)
        return split

    def split_to_homes(self, split: Dict[str, MatrixInfo], updates, like) -> Dict[str, torch.Tensor]:
        """The split layout's way there: the whole update (its local shape) of every matrix of ``split``
        homed on this rank, assembled from every holder's piece (``updates``: this rank's)."""
        with record_function("dmuon.dp_exchange"):
            # (a TP-replicated matrix's momentum lives on its TP owner: only that TP rank's DP group sends it)
            sent = [i.dp_split for i in split.values() if self.holds_momentum(i)]
            assembled = self.dp.to_homes(sent, {n: updates[n] for n in split if n in updates}, like)
        return {name: full if split[name].dp_split.team else full.view(split[name].local_shape)
                for name, full in assembled.items()}

    def split_from_homes(self, split: Dict[str, MatrixInfo], outputs, directions, narrow, like) -> Dict[str, torch.Tensor]:
        """The split layout's way back: this rank's piece of the direction of every matrix of ``split``
        it holds a piece of (a home sends its ``directions``, or for the ``narrow`` ones its NS
        ``outputs`` as 16-bit bits, which the holder widens and scales: runtime/narrow_directions.py)."""
        homed = {n: i for n, i in split.items() if any(h == self.dp.rank for h, _, _ in i.dp_split.homes()[1])}
        with record_function("dmuon.dp_exchange"):
            back = self.dp.from_homes(
                [i.dp_split for i in split.values()],
                {n: encode_direction(outputs[n], i.split, i.shape, n) if n in narrow else directions[n]
                 for n, i in homed.items()}, like, narrow)
            for name in narrow:  # (what this rank holds of a narrow direction: its bits, the home's tag)
                if name in back:
                    back[name] = self._narrow_decoder.decode(split[name], *back[name], like.dtype)
        return back

    def apply_directions(self, entries, directions) -> None:
        """Every rank: decay and the lr-scaled direction on its own shard or piece of each matrix."""
        s = self.muon
        with record_function("dmuon.apply"):
            for p, group, info in entries:
                scale = muon_direction_scale(info.split, info.shape, s.scale_mode, s.extra_scale)
                muon_apply_(p, directions[info.name], group["lr"], group["weight_decay"], scale)

    def _narrow_directions(self, infos, like: torch.Tensor) -> List[str]:
        """The split matrices whose direction goes back to its holders as 16-bit bits (runtime/
        narrow_directions.py): where the NS returns its compute dtype (CUDA; the CPU torch path
        returns the input's dtype), without TP (a home's direction is its own NS outputs), for a
        16-bit NS and wider masters. The same list on every rank: it depends only on the device type,
        the settings and the plan."""
        if like is None or self.narrow_directions is False or (self.narrow_directions is None and not like.is_cuda):
            return []
        if self.orthogonalizer is not None:  # (what a custom one returns is its own business)
            return []
        return sorted(narrow_directions([i.name for i in infos if not i.dp_split.team], self.tp.size,
                                        self.muon.ns_dtype.itemsize, like.element_size()))

    @property
    def _narrow_decoder(self) -> NarrowDecoder:
        if "_decoder" not in self.__dict__:
            self.__dict__["_decoder"] = NarrowDecoder(self.muon.scale_mode, self.muon.extra_scale)
        return self.__dict__["_decoder"]

    def _master_like(self, entries) -> Optional[torch.Tensor]:
        """A tensor of the masters' dtype and device (what updates and directions travel in)."""
        if entries:
            return entries[0][0]
        return next((p for g in self.param_groups for p in g["params"]), None)

    def _momentum_update(self, p: torch.Tensor, info: MatrixInfo, out: Optional[torch.Tensor] = None,
                         grad_scale: Optional[float] = None) -> torch.Tensor:
        """Momentum step of one matrix in place; returns its NS input (Nesterov: grad.lerp(momentum)),
        written into ``out`` when given (a view of the NS input stack). ``grad_scale``: the clip
        coefficient, applied to the grad first (``out`` given)."""
        s = self.muon
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p, dtype=self._momentum_dtype(p))
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        buf = state["momentum_buffer"]
        # a narrower stored momentum is updated in the master's dtype and rounded back once
        wide = buf if buf.dtype == p.dtype else buf.to(p.dtype)
        update = muon_momentum_fast_(wide.view(info.held_shape), grad.view(info.held_shape), s.momentum,
                                     s.nesterov, out=out, grad_scale=grad_scale)
        if wide is not buf:
            buf.copy_(wide)
        return update

    def _momentum_updates(self, entries) -> Dict[str, torch.Tensor]:
        """Momentum steps in place; the NS input of every matrix whose momentum this rank holds."""
        return {info.name: self._momentum_update(p, info) for p, _, info in entries if self.holds_momentum(info)}

    def _local_step(self, entries, grad_scale: Optional[float] = None) -> None:
        """Without TP every matrix is whole on this rank: the Nesterov updates are written straight
        into the NS input stacks and the directions applied straight from the NS outputs
        (ns_stacks.StackPlan), instead of materialising each update, stacking it, and reassembling
        split directions. The same arithmetic as the general path, in fewer passes."""
        plan, stacks = self.fill_ns_stacks(entries, grad_scale)
        with record_function("dmuon.ns"):
            outputs = self._check_outputs(plan, self.launch_ns(plan, stacks), stacks)
        self.apply_ns_outputs(plan, outputs, [(p, info, group["lr"], group["weight_decay"]) for p, group, info in entries])
        self.stats["ns_matrices_total"] += self.stats["ns_matrices"]
        self.stats["tp_bytes"] = 0

    def fill_ns_stacks(self, entries, grad_scale: Optional[float] = None, tag: Optional[int] = None):
        """The momentum pass of ``entries`` (whole matrices), written into their NS input stacks:
        (StackPlan, stacks). ``tag``: the need group whose own stacks these are (overlapped step)."""
        device = entries[0][0].device if entries else None
        plan = self._stack_plan([StackJob(info.name, tuple(info.shape), info.split, p.dtype) for p, _, info in entries],
                                device, [info for _, _, info in entries], tag)
        with record_function("dmuon.momentum"):
            stacks = self._input_stacks(plan, entries[0][0].device) if entries else []
            for j, (p, _, info) in enumerate(entries):
                view = plan.direct_view(stacks, j)
                update = self._momentum_update(p, info, out=view, grad_scale=grad_scale)
                if view is None:
                    plan.write(stacks, j, update)
        self.stats["ns_matrices"] += len(entries)
        return plan, stacks

    def apply_ns_outputs(self, plan: StackPlan, outputs, members) -> None:
        """Decay and lr-scaled direction of every (main param, info, lr, weight decay) of ``plan``'s
        jobs, straight from the NS outputs where a matrix is a view of its stack."""
        s = self.muon
        with record_function("dmuon.apply"):
            for j, (p, info, lr, wd) in enumerate(members):
                view = plan.direct_view(outputs, j)
                if view is not None:  # its pieces share one shape, so one lr multiplier
                    piece_scale = muon_lr_scale(*plan.piece_shape(j)[-2:], s.scale_mode, s.extra_scale)
                    whole = info.split is None or info.split.kind == "none"
                    muon_apply_fast_(p, view, lr, wd,  # reads any float dtype
                                     piece_scale if whole else 1.0, 1.0 if whole else piece_scale)
                    continue
                direction, scale = muon_direction(plan.outputs(outputs, j), info.split, shape=info.shape,
                                                  scale_mode=s.scale_mode, extra_scale=s.extra_scale, dtype=p.dtype)
                muon_apply_(p, direction, lr, wd, scale)

    def _gather_step(self, infos, updates, like, outputs: Optional[Dict[str, list]] = None,
                     outputs_only: Collection[str] = ()) -> Dict[str, torch.Tensor]:
        """Directions (this rank's TP shards) of matrices gathered whole to their TP owner (without TP:
        every matrix of ``infos``), orthogonalized there in batched NS calls; ``updates``: the TP-local
        update of each, ``like``: the masters' dtype and device; ``outputs`` receives the NS outputs
        of every matrix orthogonalized here; ``outputs_only``: matrices (without TP) whose direction is
        not made here (the split layout's narrow ones: their holders make it from the outputs' bits)."""
        tp_mats = [info.tp_matrix() for info in infos]
        info_of = {info.name: info for info in infos}
        full = self.tp.to_owners(tp_mats, updates, {n: i.shape for n, i in info_of.items()}, like)
        owned = [info_of[m.key] for m in self.tp.owned(tp_mats)]
        with record_function("dmuon.ns"):
            orthogonalized = self.orthogonalize_owned([(info, full[info.name]) for info in owned])
        if outputs is not None:
            outputs.update(orthogonalized)
        directions = self.directions_of([info for info in owned if info.name not in outputs_only], orthogonalized,
                                        like.dtype)
        self.stats["ns_matrices"] += len(owned)
        return self.tp.from_owners([m for m in tp_mats if m.key not in outputs_only], directions,
                                   {n: i.local_shape for n, i in info_of.items()}, like)

    def directions_of(self, infos, orthogonalized, dtype) -> Dict[str, torch.Tensor]:
        """The whole direction (``dtype``) of each matrix of ``infos`` from its NS outputs."""
        s = self.muon
        with record_function("dmuon.direction"):
            return {info.name: muon_direction(orthogonalized[info.name], info.split, shape=info.shape,
                                              scale_mode=s.scale_mode, extra_scale=s.extra_scale, dtype=dtype)[0]
                    for info in infos}

    def _distributed_gram_step(self, infos, updates, like) -> Dict[str, torch.Tensor]:
        """Directions (this rank's shards) of matrices orthogonalized by distributed Gram NS across
        the TP group: one stack per (local shape, TP owner), in the same order on every TP rank."""
        s = self.muon
        groups: Dict[tuple, list] = defaultdict(list)
        for info in infos:
            groups[(info.local_shape, info.shape, info.tp_owner)].append(info)
        out = {}
        for (local_shape, shape, owner), members in sorted(groups.items()):
            tall = shape[0] >= shape[1]  # shards are column blocks of the wide orientation
            stack = torch.stack([updates[info.name].mT if tall else updates[info.name] for info in members])
            choice = members[0].ns[0]
            result = self.tp.gram_orthogonalize(stack, owner, **dict(choice.schedule,
                                                                     compute_dtype=choice.compute_dtype))
            for info, o in zip(members, result):
                out[info.name] = muon_direction([o.mT if tall else o], None, shape=info.shape, scale_mode=s.scale_mode,
                                                extra_scale=s.extra_scale, dtype=like.dtype)[0]
            if owner == self.tp.rank:  # the owner ran the Gram-space iteration: its NS
                self.stats["ns_matrices"] += len(members)
        return out

    def orthogonalize_owned(self, jobs) -> Dict[str, List[torch.Tensor]]:
        """NS outputs of every (info, full update) job, one batched call per distinct piece shape;
        per matrix, the outputs in the order of ``info.split.pieces`` (stacks stay stacks)."""
        plan, stacks = self.owned_stacks(jobs)
        outputs = self._check_outputs(plan, self.launch_ns(plan, stacks), stacks)
        return {info.name: plan.outputs(outputs, j) for j, (info, _) in enumerate(jobs)}

    def owned_stacks(self, jobs, tag: Optional[int] = None):
        """The NS input stacks of (info, full update) jobs: (StackPlan, stacks). ``tag``: the need
        group whose own stacks these are (overlapped step)."""
        device = jobs[0][1].device if jobs else None
        plan = self._stack_plan([StackJob(info.name, tuple(u.shape), info.split, u.dtype) for info, u in jobs], device,
                                [info if isinstance(info, MatrixInfo) else None for info, _ in jobs], tag)
        stacks = self._input_stacks(plan, device) if jobs else []
        for j, (_, update) in enumerate(jobs):
            plan.write(stacks, j, update)
        return plan, stacks

    def _stack_plan(self, jobs: List[StackJob], device, infos: Sequence[Optional[MatrixInfo]] = (),
                    tag: Optional[int] = None) -> StackPlan:
        """The stacks of ``jobs`` and the NS each runs: the choices their ``MatrixInfo``s carry;
        jobs without one (``infos`` None: the row rules' selected rows, whose row count is the
        rule's and known only now) by the settings' ``NSResolver``, once per set of jobs."""
        key = (tuple(jobs), str(device), tag)
        plans = self.__dict__.setdefault("_stack_plans", {})
        if key not in plans:
            if len(plans) > 16 and tag is None:  # shapes change rarely (row rules with a new selection size)
                plans.clear()
            plan = StackPlan(jobs, tag)
            infos = list(infos) or [None] * len(jobs)
            planned = {}
            for j, info in enumerate(infos):
                for (g, _, _, _), choice in zip(plan.pieces[j], info.ns if info is not None else ()):
                    planned.setdefault(g, choice)
            resolver = self.muon.ns_resolver(device) if device is not None and None in infos else None
            plan.ns = [planned[g] if g in planned else resolver.choice(m, n, size)
                       for g, ((m, n, _), size) in enumerate(zip(plan.groups, plan.sizes))]
            plans[key] = plan
        return plans[key]

    def _graph_key(self, plan: StackPlan, device) -> tuple:
        # a need group's stacks are its own graph's inputs (groups of equal shapes are all in flight at once)
        return (plan.tag, *((shape, dtype, str(device)) for shape, (_, _, dtype) in zip(plan.stack_shapes(), plan.groups)))

    def _input_stacks(self, plan: StackPlan, device) -> List[torch.Tensor]:
        """Empty NS input stacks for ``plan``: the CUDA graph's own input buffers under
        ns_launch='graph' (written in place, so a replay copies nothing), else new tensors."""
        graph = self._graphs.get(self._graph_key(plan, device)) if self.muon.ns_launch == "graph" else None
        return list(graph.static_inputs) if graph is not None else plan.new_stacks(device)

    def launch_ns(self, plan: StackPlan, stacks: List[torch.Tensor]) -> List[torch.Tensor]:
        """One NS result per stack, launched as ``MuonSettings.ns_launch`` says (unchecked: see
        ``_check_outputs``)."""
        s = self.muon
        self.stats["ns_calls"] += len(stacks)
        if not stacks:
            return []
        for x, choice in zip(stacks, plan.ns):
            shape = f"{x.size(-2)}x{x.size(-1)}"
            if shape not in self.ns_paths:
                custom = s.ns_launch == "eager" and self.orthogonalizer is not None
                self.ns_paths[shape] = "custom" if custom else choice.label(s.coefficients)
        if s.ns_launch == "eager" or not stacks[0].is_cuda:
            outputs = [self.orthogonalizer(x) if self.orthogonalizer is not None else run_ns(x, choice)
                       for x, choice in zip(stacks, plan.ns)]
        else:
            def calls():  # each stack's method and keyword arguments, as its NSChoice says
                return dict(method=[c.method for c in plan.ns], per_stack_kwargs=[c.kwargs() for c in plan.ns])

            if s.ns_launch == "streams":
                outputs = orthogonalize_groups(stacks, **calls())
            else:
                key = self._graph_key(plan, stacks[0].device)
                graph = self._graphs.get(key)
                if graph is None:  # captured on these very stacks: they become its input buffers
                    graph = self._graphs[key] = GraphedGroups(stacks, adopt_inputs=True, **calls())
                outputs = graph(stacks)  # the graph's static outputs: consumed before the next step
        return outputs

    def check_ns_outputs(self, plan: StackPlan, outputs: List[torch.Tensor], stacks: List[torch.Tensor],
                         standard_retry: bool = True) -> List[torch.Tensor]:
        """``_check_outputs`` for the overlapped step's groups (kept under that name because
        bench/momentum_spectra.py wraps it to record every NS output of a run)."""
        return self._check_outputs(plan, outputs, stacks, standard_retry=standard_retry)

    def _check_outputs(self, plan: StackPlan, outputs: List[torch.Tensor], stacks: List[torch.Tensor],
                       standard_retry: bool = True) -> List[torch.Tensor]:
        """NaN/Inf outputs recomputed in float32, and the online NS check when due. Without
        ``standard_retry`` the stacks whose NS is standard (normalized input: finite whenever the
        input is) are not read back, which saves the overlapped step a host sync."""
        s = self.muon
        if not outputs:
            return outputs
        if s.retry_nonfinite:
            read = [standard_retry or c.runs != "standard" or (s.ns_launch == "eager" and self.orthogonalizer is not None)
                    for c in plan.ns]
            if all(read):
                outputs = self._retry_nonfinite(outputs, stacks)
            elif any(read):
                kept = self._retry_nonfinite([o for o, r in zip(outputs, read) if r], [x for x, r in zip(stacks, read) if r])
                it = iter(kept)
                outputs = [next(it) if r else o for o, r in zip(outputs, read)]
        if self.ns_check.due():
            with record_function("dmuon.ns_check"):
                outputs = self.ns_check.check(outputs, stacks, plan.slot_names())
        return outputs

    def _retry_nonfinite(self, outputs: List[torch.Tensor], stacks: List[torch.Tensor]) -> List[torch.Tensor]:
        """Matrices whose NS output holds NaN/Inf are recomputed by the float32 torch path (one
        host sync for the step's stacks together)."""
        before = NONFINITE_METRICS["fp32_retries"]
        outputs = retry_nonfinite_stacks(outputs, stacks, self._fp32_orthogonalizer)
        retried = NONFINITE_METRICS["fp32_retries"] - before
        self.stats["ns_fp32_retries"] += retried
        self.stats["ns_fp32_retries_total"] += retried
        return outputs
