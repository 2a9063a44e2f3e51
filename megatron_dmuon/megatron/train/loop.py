"""The training loop of the main job: resume, iterate (fault injection, the step, the scheduler, the
run-time checks, saves, progress lines, validation), and what it leaves for the summary."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import time

import torch

from .checkpoints import load_if_requested, save
from .run_errors import job_error, params_finite, stop_if_not_learning


class TimedOptimizer:
    """The optimizer as ``train_step`` sees it: ``step()`` timed between device syncs (``last_ms``),
    under torch.profiler when ``profile`` is set; everything else is the optimizer's own."""

    def __init__(self, optimizer, sync, trace_path=None):
        self.optimizer, self.sync, self.trace_path = optimizer, sync, trace_path
        self.profile = False
        self.last_ms = None

    def __getattr__(self, name):
        return getattr(self.optimizer, name)

    def step(self):
        self.sync()
        t = time.perf_counter()
        out = profiled(self.optimizer.step, self.trace_path) if self.profile else self.optimizer.step()
        self.sync()
        self.last_ms = (time.perf_counter() - t) * 1e3
        return out


def profiled(step, trace_path=None):
    """Run ``step()`` under torch.profiler (see ``Profile``)."""
    prof = Profile(trace_path, "the optimizer step")
    out = step()
    prof.stop()
    return out


class Profile:
    """torch.profiler from construction to ``stop()``: then the kernels by total device time (and
    the record_function ranges) on stdout, and a Chrome trace at ``trace_path`` if given."""

    def __init__(self, trace_path=None, what="the optimizer step"):
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self.trace_path, self.what = trace_path, what
        self.prof = profile(activities=activities)
        self.prof.start()

    def stop(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.prof.stop()
        from torch.autograd.profiler_util import EventList

        sort = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
        averages = self.prof.key_averages()
        # every DMuon phase apart too: on a busy host the top rows can leave some out
        phases = EventList([e for e in averages if e.key.startswith("dmuon.")])
        print(f"> profile of {self.what}\n" + averages.table(sort_by=sort, row_limit=45, max_name_column_width=90)
              + ("\n> DMuon's phases\n" + phases.table(sort_by=sort, max_name_column_width=90) if len(phases) else ""),
              flush=True)
        if self.trace_path:
            self.prof.export_chrome_trace(self.trace_path)


def maybe_fail(args, iteration, rank, world) -> None:
    """--fail-at-iteration: the chosen rank dies as a crashed node would (first attempt only)."""
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if args.fail_at_iteration == iteration and first_attempt and rank == args.fail_rank % world:
        print(f"> fault injection: SIGKILL rank {rank} at iteration {iteration}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


class IntervalLog:
    """Megatron-style progress line: averages over the log interval (ms, optimizer ms, throughput
    per GPU, lm loss), the last iteration's lr and grad norm (as Megatron-LM prints them), and the
    interval's skipped (update not applied) and NaN/Inf-loss iteration counts."""

    def __init__(self, args, world: int, flops_per_iter: float):
        self.args, self.world, self.flops = args, world, flops_per_iter
        self.tokens = args.global_batch_size * args.seq_length
        self._reset()

    def _reset(self):
        self.n = self.skipped = self.nan = self.finite = 0
        self.step_ms = self.opt_ms = self.loss = 0.0

    def add(self, step_ms, opt_ms, loss, ok):
        self.n += 1
        self.step_ms += step_ms
        self.opt_ms += opt_ms
        self.skipped += int(not ok)
        if math.isfinite(loss):
            self.loss += loss
            self.finite += 1
        else:
            self.nan += 1

    def interval_loss(self) -> float:
        return self.loss / self.finite if self.finite else float("nan")

    def line(self, it, lr, grad_norm, consumed_samples: int) -> str:
        a, ms = self.args, self.step_ms / self.n
        loss = self.loss / self.finite if self.finite else float("nan")
        out = (f" iteration {it:8d}/{a.train_iters:8d} | consumed samples: {consumed_samples:10d} | "
               f"elapsed time per iteration (ms): {ms:.1f} | optimizer (ms): {self.opt_ms / self.n:.1f} | "
               f"throughput per GPU (TFLOP/s/GPU): {self.flops / (ms / 1e3) / self.world / 1e12:.2f} | "
               f"tokens per second per GPU: {self.tokens / (ms / 1e3) / self.world:.0f} | "
               f"learning rate: {lr:.6E} | global batch size: {a.global_batch_size:5d} | "
               f"lm loss: {loss:.6E} | grad norm: {float('nan') if grad_norm is None else float(grad_norm):.3f} | "
               f"number of skipped iterations: {self.skipped:3d} | number of nan iterations: {self.nan:3d} |")
        self._reset()
        return out


class Charts:
    """--tensorboard-dir / --wandb-project: at each logged iteration DMuon's metrics (megatron/metrics.py,
    gathered on every rank) and the lm loss and learning rate under Megatron-LM's names, written by rank 0;
    rank 0 also prints the metrics' line (what the charts hold)."""

    def __init__(self, args, rank: int, opt, chunks):
        from megatron_dmuon.megatron.metrics import tensorboard_writer, wandb_run

        self.rank = rank
        wanted = bool(args.tensorboard_dir or args.wandb_project)
        self.metrics = opt.enable_metrics(chunks) if wanted and hasattr(opt, "enable_metrics") else None
        self.tensorboard = tensorboard_writer(args.tensorboard_dir) if args.tensorboard_dir and rank == 0 else None
        self.wandb = wandb_run(args.wandb_project, args.wandb_exp_name, args.wandb_save_dir or args.tensorboard_dir,
                               vars(args)) if args.wandb_project and rank == 0 else None

    def write(self, iteration: int, loss: float, lr: float) -> None:
        if self.metrics is None and self.tensorboard is None and self.wandb is None:
            return
        values = self.metrics.values() if self.metrics is not None else {}  # (a collective: every rank)
        if self.rank != 0:
            return
        if values:
            print(f"> dmuon metrics {json.dumps({'iteration': iteration, **values}, sort_keys=True)}", flush=True)
        from megatron_dmuon.megatron.metrics import write_values

        write_values(iteration, dict(values, **{"lm loss": loss, "learning-rate": lr}), self.tensorboard, self.wandb)

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()


def validation_runner(args, data, dp_size, dp_rank, rank, loss_of):
    """``evaluate(iteration) -> loss`` over the held-out split (printed as Megatron-LM prints it),
    or None when validation is off. Every evaluation reads the same --eval-iters x
    --global-batch-size windows, this DP rank its share of each, in micro-batches."""
    if args.eval_iters == 0:  # (with --eval-iters > 0 the start-up checks made sure a validation window fits)
        return None
    per_rank = args.global_batch_size // dp_size
    micro = [m for batch in data.validation_batches(args.eval_iters, args.global_batch_size)
             for m in batch[dp_rank * per_rank:(dp_rank + 1) * per_rank].split(args.micro_batch_size)]

    def evaluate(iteration: int) -> float:
        loss = loss_of(micro)
        if rank == 0:
            text = (f" validation loss at iteration {iteration} | lm loss value: {loss:.6E} | "
                    f"lm loss PPL: {math.exp(min(loss, 700)):.6E} | ")
            print("-" * len(text) + "\n" + text + "\n" + "-" * len(text), flush=True)
        return loss

    return evaluate


@dataclasses.dataclass
class History:
    """What the loop leaves for the summary: one record per trained iteration, the validation losses."""

    start: int  # the iteration resumed after (0: a fresh start)
    consumed: int = 0  # train samples consumed so far (each iteration: --global-batch-size, as Megatron counts)
    timings: list = dataclasses.field(default_factory=list)
    validation: list = dataclasses.field(default_factory=list)
    first_loss: float = None
    last_loss: float = None
    skipped: int = 0
    last_ok: bool = True  # the last trained iteration's update was applied


def train(job) -> History:
    """Resume (--load), then iterations start+1 .. --train-iters on ``job`` (a job.Job)."""
    from megatron_dmuon.megatron.gpt import eval_loss, gpt_training_flops, on_gpu, train_step

    args, rank, ddp, opt, sched, data = job.args, job.rank, job.ddp, job.opt, job.sched, job.data
    # the current stream only: under --dmuon-overlap-step on, a step's Newton-Schulz runs on a side
    # stream into the next iteration's forward (a device-wide sync would serialize it again)
    sync = (lambda: torch.cuda.current_stream().synchronize()) if on_gpu() else (lambda: None)
    timed = TimedOptimizer(opt, sync, args.profile_out)
    log = IntervalLog(args, job.world, gpt_training_flops(job.shape, args.global_batch_size))
    evaluate = validation_runner(args, data, job.dp_size, job.dp_rank, rank, lambda micro: eval_loss(
        [ddp], micro, args.seq_length, args.micro_batch_size))
    run = History(*load_if_requested(args, ddp, opt, sched, rank))
    if run.start >= args.train_iters and rank == 0:
        print(f"> the checkpoint is at iteration {run.start} and --train-iters is {args.train_iters}: nothing to train "
              "(raise --train-iters to continue, with --override-opt_param-scheduler for the longer schedule or "
              "--use-checkpoint-opt_param-scheduler to keep the saved one)", flush=True)
    charts = Charts(args, rank, opt, [ddp])  # --tensorboard-dir / --wandb-project (megatron/metrics.py)
    streak = 0  # consecutive iterations without a finite loss and an applied update
    whole = None  # the --profile-iterations profile while it runs
    for it in range(run.start + 1, args.train_iters + 1):
        maybe_fail(args, it, rank, job.world)
        profile_here = rank == 0 and args.profile_optimizer_at == it
        timed.profile = profile_here and not args.profile_iterations
        sync()
        if profile_here and args.profile_iterations:  # whole iterations: the overlapped NS beside the forward
            whole = Profile(args.profile_out, f"iterations {it}..{it + args.profile_iterations - 1}")
        t0 = time.perf_counter()
        # this rank's slice of the global batch of samples [consumed, consumed + global batch): the same
        # samples at any DP size (data.py)
        micro = data.micro_batches(run.consumed, args.global_batch_size, job.dp_size, job.dp_rank,
                                   args.micro_batch_size)
        loss, grad_norm, _, ok = train_step([ddp], timed, micro, args.seq_length, args.micro_batch_size)
        run.consumed += args.global_batch_size  # (a skipped step consumed its batch too, as in Megatron-LM)
        sync()
        step_ms = (time.perf_counter() - t0) * 1e3
        if whole is not None and it == args.profile_optimizer_at + args.profile_iterations - 1:
            whole.stop()
            whole = None
        if ok:
            sched.step(increment=args.global_batch_size)  # Megatron counts samples (consumed samples)
        run.skipped += not ok  # a non-finite gradient: skipped on every rank, nothing changed
        run.last_ok = ok
        streak = 0 if ok and math.isfinite(loss) else streak + 1
        stop_if_not_learning(args, it, streak, loss, ok, opt)
        if args.save and ((args.save_interval and it % args.save_interval == 0) or it == args.train_iters):
            if hasattr(opt, "finish_overlapped_step"):
                opt.finish_overlapped_step()
            if not params_finite(opt):
                job_error(f"the parameters are not finite after iteration {it}: not saved (the last checkpoint in "
                          f"{args.save} is still the latest); lower --lr or keep --clip-grad on", 1)
            save(args, it, ddp, opt, sched, rank, run.consumed)
        run.timings.append({"iteration": it, "step_ms": step_ms, "optimizer_ms": timed.last_ms, "loss": loss})
        log.add(step_ms, timed.last_ms, loss, ok)
        run.first_loss = loss if run.first_loss is None else run.first_loss
        run.last_loss = loss
        if it % args.log_interval == 0 or it == 1 or it == args.train_iters:
            interval_loss = log.interval_loss()
            line = log.line(it, opt.param_groups[0]["lr"], grad_norm, run.consumed)
            if rank == 0:
                print(line, flush=True)
            charts.write(it, interval_loss, opt.param_groups[0]["lr"])
        if evaluate and (it == args.train_iters or (args.eval_interval and it % args.eval_interval == 0)):
            run.validation.append({"iteration": it, "loss": evaluate(it)})
    if evaluate and not run.timings:  # nothing trained: the loaded model's validation loss
        run.validation.append({"iteration": run.start, "loss": evaluate(run.start)})
    charts.close()
    return run
