"""Make megatron-core's hard-coded CUDA calls run on the CPU (test infrastructure only).

megatron-core 0.19 allocates buffers with ``device=torch.cuda.current_device()``, creates CUDA
streams, reads/writes the CUDA RNG state and compares ``tensor.type()`` with
``'torch.cuda.FloatTensor'``. :func:`install` redirects all of these to the CPU so the real
DDP/DistributedOptimizer code paths can be exercised with the gloo backend. Never import this
on a GPU run.
"""
from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

_INSTALLED = False
_MODE = None


def _is_cuda_device(device) -> bool:
    if device is None:
        return False
    if isinstance(device, int):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


class _CpuDeviceMode(TorchFunctionMode):
    """Rewrites ``device='cuda'``/int device arguments to the CPU, and ``.cuda()`` to identity."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.cuda:
            return args[0]
        if func in (torch.Tensor.to,) and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu") + tuple(args[2:])
        if func is torch.Tensor.pin_memory:
            return args[0]
        if func is torch.Tensor.float and args[0].dtype == torch.float64:
            return args[0]  # float64 runs stay float64 through Megatron's fp32 casts (see _TYPE_NAMES)
        return func(*args, **kwargs)


class _DummyStream:
    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, event=None):
        return event or _DummyEvent()

    def synchronize(self):
        pass

    def query(self):
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _DummyEvent:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, *args, **kwargs):
        pass

    def wait(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
    # float64 answers as a float32 tensor: Megatron's "full precision" code path (DDP buffers,
    # DistributedOptimizer fp32 groups, grad norm) then carries float64, which lets the CPU tests
    # compare TP/PP/EP runs with the single-process reference far below fp32 reduction-order noise
    torch.float64: "torch.cuda.FloatTensor",
}


def install() -> None:
    """Install the CPU shim in this process (idempotent)."""
    global _INSTALLED, _MODE
    if _INSTALLED:
        return
    cuda = torch.cuda
    cuda.is_available = lambda: False  # the run is a CPU run even on a machine with a GPU
    cuda.current_device = lambda: 0
    cuda.device_count = lambda: 1
    cuda.set_device = lambda *a, **k: None
    cuda.Stream = _DummyStream
    cuda.Event = _DummyEvent
    cuda.stream = lambda s=None: contextlib.nullcontext()
    cuda.current_stream = lambda *a, **k: _DummyStream()
    cuda.default_stream = lambda *a, **k: _DummyStream()
    cuda.synchronize = lambda *a, **k: None
    cuda.empty_cache = lambda: None
    cuda.memory_allocated = lambda *a, **k: 0
    cuda.max_memory_allocated = lambda *a, **k: 0
    # The CUDA generator is the CPU default generator here (not torch.manual_seed: it would recurse).
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    cuda.manual_seed_all = cuda.manual_seed
    cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    cuda.random.get_rng_state = cuda.get_rng_state
    cuda.random.set_rng_state = cuda.set_rng_state

    from megatron.core.tensor_parallel import random as mp_random

    mp_random._set_cuda_rng_state = lambda new_state, *a, **k: torch.set_rng_state(new_state)
    if hasattr(mp_random, "_get_cuda_rng_state"):
        mp_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()

    # MoE token dispatch moves split sizes "from the GPU" to numpy for all_to_all_single; on the
    # CPU the tensors are already there, so Megatron's helper would hand collectives a tensor
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    def _to_host(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor) and as_numpy:
            return tensor.numpy()
        return tensor

    moe_utils.maybe_move_tensor_to_cpu = _to_host
    token_dispatcher.maybe_move_tensor_to_cpu = _to_host

    original_type = torch.Tensor.type

    def _type(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs:
            name = _TYPE_NAMES.get(self.dtype)
            if name is not None and self.device.type == "cpu":
                return name
            return original_type(self)
        return original_type(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = _type
    _MODE = _CpuDeviceMode()
    _MODE.__enter__()

    # autograd's engine runs custom Functions' backward without the Python mode stack, and
    # Megatron's backward (e.g. MoE all-to-all) also allocates on "the current CUDA device"
    from torch.autograd.function import BackwardCFunction

    forward_apply = BackwardCFunction.apply

    def _apply_on_cpu(self, *args):
        with _CpuDeviceMode():
            return forward_apply(self, *args)

    BackwardCFunction.apply = _apply_on_cpu
    _INSTALLED = True


def installed() -> bool:
    return _INSTALLED
