"""DMuon in a hand-written megatron-core training loop (the README's Python snippet, complete).

    torchrun --nproc-per-node 2 examples/minimal_loop.py

The one line a hand-written loop must not forget is `ddp.finish_grad_sync()` after backward: it
reduces every gradient to the rank that owns it. (Megatron's schedules call it for you through
`config.finalize_model_grads_func = finalize_model_grads`.) DMuon raises if a step comes without it.
"""
import os

import torch
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

from megatron_dmuon.megatron.gpt import GPTShape, build_gpt, causal_batch
from megatron_dmuon.megatron.ddp import build_dmuon_ddp
from megatron_dmuon.megatron.optimizer import DMuonConfig, get_dmuon_optimizer

if torch.cuda.is_available():
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    backend, device = "nccl", "cuda"
else:  # CPU runs only: megatron-core hard-codes CUDA calls that the project's test shim maps to CPU
    from megatron_dmuon.testing import cpu_shim

    cpu_shim.install()
    backend, device = "gloo", "cpu"
torch.distributed.init_process_group(backend)
parallel_state.initialize_model_parallel(1, 1)
torch.manual_seed(0)
model_parallel_cuda_manual_seed(0)

model = build_gpt(GPTShape())  # any megatron-core model
ddp = build_dmuon_ddp(model.config, DistributedDataParallelConfig(use_distributed_optimizer=True), model)
ddp.broadcast_params()
opt = get_dmuon_optimizer(OptimizerConfig(optimizer="adam", lr=3e-3, weight_decay=0.1, use_distributed_optimizer=True),
                          [ddp], DMuonConfig())  # DMuonConfig() = Megatron-LM's Muon defaults

rank = torch.distributed.get_rank()
for step in range(20):
    ddp.zero_grad_buffer()
    opt.zero_grad()
    start = torch.randint(0, 50, (8, 1), generator=torch.Generator().manual_seed(step * 100 + rank))
    batch = causal_batch(((start + torch.arange(33)) % 50).to(device))  # learnable: counting mod 50
    batch.pop("loss_mask")
    loss = model(**batch).float().mean()
    loss.backward()
    ddp.finish_grad_sync()  # reduce-scatter every gradient to its owner: without it nothing is reduced
    ok, grad_norm, _ = opt.step()  # owners run Muon / AdamW, then publish the new params to every rank
    if rank == 0 and step % 5 == 4:
        print(f"step {step + 1}: loss {loss.item():.3f}, grad norm {float(grad_norm):.3f}", flush=True)
torch.distributed.destroy_process_group()
