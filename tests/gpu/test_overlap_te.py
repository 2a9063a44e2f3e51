"""`--dmuon-overlap-step` on one GPU with Transformer Engine layers, in bf16 with fp32 grads and masters,
fused wgrad accumulation where Apex's kernel is built (the configuration Megatron-LM runs).

'on' and 'backward' run their Newton–Schulz on a side stream: 'on' from the step, finished by the next
forward's param-sync hooks; 'backward' from the grad reduce of each bucket group in the last backward,
behind the reduce's handle. Each must give bit for bit the params and losses of 'sync' (the same cut
stacks inside the step), under every NS launch mode, across a skipped step (a NaN grad) and, for
'backward', under clipping that fires on some steps (those redo their groups) and across a checkpoint
saved and resumed mid-run. CPU gloo covers DP=2, PP/VPP and EP (tests/runtime/test_overlap_step.py); here the
streams are real. tests/gpu/run_h200.sh runs the suite with several hardware queues
(CUDA_DEVICE_MAX_CONNECTIONS=8), so the side stream really runs beside the model's stream.
"""
import os

import pytest
import torch

from tests.gpu.conftest import apex_wgrad_available, requires_te

pytestmark = [requires_te, pytest.mark.usefixtures("one_gpu_world")]

SHAPE = dict(transformer_impl="transformer_engine", bf16=True, num_layers=4, hidden_size=64, num_attention_heads=4,
             num_query_groups=2, ffn_hidden_size=160)
BASE = dict(steps=6, grad_accum=2, overlap=True, bucket_size=2000, nan_at=(2, 0))


def _variants(modes, launch, clip_grad, **kw):
    from megatron_dmuon.testing.overlap_workers import overlap_step_variants

    if os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1":
        pytest.skip("the overlapped modes are refused under one hardware queue: run tests/gpu/run_h200.sh (8)")
    shape = dict(SHAPE, gradient_accumulation_fusion=apex_wgrad_available())
    variants = {m: {"overlap_step": m, "ns_method": "auto", "ns_launch": launch, "ns_check_interval": 2}
                for m in modes}
    return overlap_step_variants(0, 1, variants, shape_kw=shape, ns_dtype="bfloat16", clip_grad=clip_grad,
                                 **{**BASE, **kw})


def _assert_bitwise(a, b):
    from megatron_dmuon.testing.compare import full_params

    pa, pb = full_params([a]), full_params([b])
    differ = [n for n in pa if not torch.equal(pa[n], pb[n])]
    assert not differ, differ[:5]
    assert a["losses"] == b["losses"] and a["grad_norms"] == b["grad_norms"]


@pytest.mark.parametrize("launch", ["eager", "streams", "graph"])
def test_on_and_backward_equal_sync_on_the_gpu(launch):
    """--clip-grad 0: every group of every step started in the backward (the NaN-skipped one too,
    then dropped with its momenta restored), none left in flight; 'on' and 'backward' = 'sync'."""
    runs = _variants(("sync", "on", "backward"), launch, clip_grad=0.0)
    for mode in ("on", "backward"):
        _assert_bitwise(runs[mode], runs["sync"])
        assert runs[mode]["pending_after"] == 0 and runs[mode]["groups_left"] == 0
    assert runs["sync"]["updated"].count(False) == 1  # the NaN step skipped, by every mode alike
    assert len(runs["backward"]["needs"]) >= 2
    assert runs["backward"]["groups_early"] == BASE["steps"] * len(runs["backward"]["needs"])
    assert runs["backward"]["redos"] == 0


def test_backward_under_clipping_and_resume_equals_sync_on_the_gpu(tmp_path):
    """Clipping at a threshold between the middle two of an unclipped run's grad norms:
    clipped steps redo their groups inside the step, the others keep what the backward started; a
    torch_dist checkpoint at step 4 (the save finishes the groups in flight) resumes bit for bit."""
    from megatron_dmuon.testing.compare import full_params

    free = _variants(("sync",), "graph", clip_grad=0.0)["sync"]
    ranked = sorted(n for n, ok in zip(free["grad_norms"], free["updated"]) if ok)
    threshold = (ranked[len(ranked) // 2 - 1] + ranked[len(ranked) // 2]) / 2  # between two norms, not on one
    runs = _variants(("sync", "backward"), "graph", clip_grad=threshold, resume=("backward", 4, str(tmp_path)))
    _assert_bitwise(runs["backward"], runs["sync"])
    norms = [n for n, ok in zip(runs["sync"]["grad_norms"], runs["sync"]["updated"]) if ok]
    clipped = sum(n > threshold for n in norms)
    print(f"grad norms {['%.4f' % n for n in norms]}, clip {threshold:.4f}: {clipped} clipped, "
          f"redos {runs['backward']['redos']}")
    assert 0 < clipped < len(norms)
    assert runs["backward"]["redos"] == clipped * len(runs["backward"]["needs"])
    resumed, whole = full_params([runs["backward+resumed"]]), full_params([runs["backward"]])
    assert all(torch.equal(resumed[n], whole[n]) for n in whole)
    assert runs["backward+resumed"]["losses"] == runs["backward"]["losses"][4:]
