"""The GPU suite (one CUDA GPU; tests/gpu/run_h200.sh runs it on the H200 with Transformer Engine).

Every test here runs in this pytest process at world size 1 (NCCL), the way a one-GPU Megatron-LM run
does: the process group and Megatron's parallel state are made once per session. Without CUDA, or
without Transformer Engine for the tests that need it, the tests are skipped (never failed), so CI on
CPU collects and skips them."""
import os

import pytest
import torch


def te_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # ImportError, or a TE build that does not load here
        return False
    return True


def apex_wgrad_available() -> bool:
    try:
        import fused_weight_gradient_mlp_cuda  # noqa: F401
    except Exception:
        return False
    return True


requires_te = pytest.mark.skipif(not te_available(), reason="needs a CUDA GPU and Transformer Engine")


@pytest.fixture(scope="session")
def one_gpu_world():
    """A one-rank NCCL process group and Megatron's parallel state (TP = PP = EP = 1)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from megatron_dmuon.testing.multiproc import free_port

    torch.cuda.set_device(0)
    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        torch.distributed.init_process_group("nccl", rank=0, world_size=1)
    # TF32 off: the fp32 runs are compared with their references in true fp32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    from megatron_dmuon.testing.workers import init_parallel

    init_parallel()
    yield
