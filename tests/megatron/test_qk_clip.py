"""MuonClip (--qk-clip) under DMuon on real megatron-core (gloo, CPU): Megatron's own clip_qk after
DMuon's step, through megatron/qk_clip.py, against the single-process reference with its own
QK-clip (testing/qk_clip_reference.py). No Transformer Engine here, so every layer is given planted
per-head max logits each step, different per DP rank (Megatron's MAX all-reduce decides)."""
import pytest
import torch

from megatron_dmuon.testing.compare import full_optimizer_state, full_params, rel_diffs, run_reference
from megatron_dmuon.testing.multiproc import run_distributed
from megatron_dmuon.testing.qk_clip_reference import qk_row_factors, reduced_max_logits

QK = dict(threshold=1.0, alpha=0.4)
STEPS = 6
FP32 = dict(steps=STEPS, grad_accum=2)
RUNS = {"sync": FP32, "overlap": dict(FP32, overlap=True, bucket_size=6000)}  # several buckets
HEADS, GROUPS, HEAD_DIM, LAYERS = 4, 2, 16, 2  # GPTShape(): GQA, 2 heads per query group


@pytest.fixture(scope="module")
def world():
    """One DP=2 world for every case: the fp32 runs with and without overlap, then the bf16 check."""
    return run_distributed("megatron_dmuon.testing.qk_clip_workers:qk_clip_world", 2,
                           kwargs=dict(**QK, runs=RUNS, bf16=dict(steps=2, grad_accum=1), recorder=True))


@pytest.fixture(scope="module")
def reference(world):
    return run_reference(2, layouts=world[0]["sync"]["layouts"], qk_clip=QK, **FP32)


def _clipped_groups(step, layer):
    factors = qk_row_factors(reduced_max_logits(step, layer, 2, HEADS, QK["threshold"]), HEADS, GROUPS, HEAD_DIM,
                             QK["threshold"], QK["alpha"])
    return [bool(factors[g * 4 * HEAD_DIM] < 1) for g in range(GROUPS)]  # a group's first query row


def test_the_planted_logits_clip_some_groups_and_spare_others():
    # the test below could not tell a missing clip from a right one if every group were spared,
    # nor a group mix-up if every group were clipped alike
    flags = [c for step in range(STEPS) for layer in range(LAYERS) for c in _clipped_groups(step, layer)]
    assert 0.2 < sum(flags) / len(flags) < 0.8, flags
    per_rank = [reduced_max_logits(0, 0, 1, HEADS, 1.0), reduced_max_logits(0, 0, 2, HEADS, 1.0)]
    assert not torch.equal(*per_rank)  # the second rank's logits change the maximum


@pytest.mark.parametrize("name", list(RUNS))
def test_qk_clip_matches_the_reference_in_fp32(world, reference, name):
    results = [r[name] for r in world]
    diffs = rel_diffs(full_params(results), reference["params"])  # (also: both DP replicas agree)
    assert max(diffs.values()) <= 1e-6, sorted(diffs.items(), key=lambda x: -x[1])[:3]
    assert results[0]["losses"] == pytest.approx(reference["losses"], rel=1e-6)
    # the masters DMuon steps (an fp32 param is its own master) hold the clipped weights
    state = full_optimizer_state(results)
    for layer in range(LAYERS):
        name_qkv = f"decoder.layers.{layer}.self_attention.linear_qkv.weight"
        master = state[name_qkv]["param"].view(reference["params"][name_qkv].shape)
        assert torch.equal(master.float(), reference["params"][name_qkv])
    # clip_qk returns Megatron's max logit over layers and heads after the MAX over DP
    expected = [max(float(reduced_max_logits(s, layer, 2, HEADS, QK["threshold"]).max()) for layer in range(LAYERS))
                for s in range(STEPS)]
    assert all(r[name]["max_logits"] == pytest.approx(expected, rel=1e-7) for r in world)


def test_without_the_clip_the_run_would_differ(world):
    # the reference without QK-clip is far from the run: the clip really acted on the weights
    plain = run_reference(2, layouts=world[0]["sync"]["layouts"], **FP32)
    diffs = rel_diffs(full_params([r["sync"] for r in world]), plain["params"])
    assert min(diffs[f"decoder.layers.{layer}.self_attention.linear_qkv.weight"] for layer in range(LAYERS)) > 1e-2


def test_bf16_the_owner_master_gets_the_clip(world):
    layers = [r["bf16"]["layers"] for r in world]
    for layer in range(LAYERS):
        entries = [by_rank[layer] for by_rank in layers]
        assert sum(e["owner"] for e in entries) == 1  # one DP owner holds the whole fp32 master
        owner = next(e for e in entries if e["owner"])
        assert owner["master_rel_err"] == 0.0 and owner["master_changed"] > 1e-3  # rescaled by the factors
        assert all(e["weight_exact"] for e in entries)  # every rank's bf16 weight, for the next forward
        assert all(e["main_param_restored"] for e in entries)  # Megatron's main_param as it was
        assert 0 < owner["clipped_rows"]


def test_megatrons_own_clip_qk_fails_on_dmuons_bf16_masters(world):
    # what --qk-clip did under DMuon before megatron/qk_clip.py (why it was refused): the owner's
    # flat master cannot take Megatron's 2-D copy, the other rank has main_param None
    errors = sorted(r["bf16"]["megatron_error"] or "" for r in world)
    assert errors[0].startswith("AttributeError: 'NoneType' object has no attribute 'data'"), errors
    assert errors[1].startswith("RuntimeError: The size of tensor a"), errors


def test_the_local_attentions_recorder_records_what_te_would(world):
    # testing/local_max_logits stands in for Transformer Engine's max-logit recording in the GPU and
    # Megatron-LM loop comparisons (no TE here): per head, the max over batch and unmasked
    # positions of the scaled logits, a running max over forwards, the attention's output unchanged
    for r in world:
        got = r["recorder"]
        assert got["shape"] == [HEADS] and got["unrecorded"] is None
        assert max(got["errors"]) <= 1e-5, got["errors"]
        assert got["outputs_equal"] == [True, True, True]


def _model_config(**kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, qk_clip=True, **kw)


@pytest.mark.parametrize("kw,match", [
    (dict(tensor_model_parallel_size=2), "--qk-clip needs --tensor-model-parallel-size 1"),
    (dict(multi_latent_attention=True), "--qk-clip with --multi-latent-attention"),
])
def test_where_megatrons_clip_cannot_run_it_is_refused_at_start_up(kw, match):
    from megatron_dmuon.megatron.config_checks import check_model_parallel_config

    with pytest.raises(ValueError, match=match):
        check_model_parallel_config(_model_config(**kw))
    check_model_parallel_config(_model_config())  # --qk-clip itself is accepted


def test_a_linear_qkv_stepping_by_adamw_is_refused_by_name():
    import types

    from megatron_dmuon.megatron.qk_clip import check_qk_clip_plan

    record = types.SimpleNamespace(name="decoder.layers.0.self_attention.linear_qkv.weight", use_muon=False,
                                   reason="Megatron marks it use_muon=False")
    plan = types.SimpleNamespace(records=[record], record=lambda name: record)
    with pytest.raises(ValueError, match="--qk-clip .* use_muon=False"):
        check_qk_clip_plan(types.SimpleNamespace(qk_clip=True), plan)
    check_qk_clip_plan(types.SimpleNamespace(qk_clip=False), plan)


def test_chunks_that_are_not_dmuons_go_to_megatrons_clip_qk_unchanged(monkeypatch):
    import types

    import megatron.core.optimizer.qk_clip as megatron_qk_clip

    from megatron_dmuon.megatron.qk_clip import clip_qk

    seen = []
    monkeypatch.setattr(megatron_qk_clip, "clip_qk", lambda model, log_max_only=False: seen.append((model, log_max_only)) or 3.0)
    plain = [types.SimpleNamespace(module=types.SimpleNamespace())]  # Megatron's own DDP: no dmuon_plan
    assert clip_qk(plain, log_max_only=True) == 3.0 and seen == [(plain, True)]
    weight = types.SimpleNamespace(main_param=None)  # a non-owner's bf16 weight
    layer = types.SimpleNamespace(self_attention=types.SimpleNamespace(linear_qkv=types.SimpleNamespace(weight=weight)))
    model = types.SimpleNamespace(decoder=types.SimpleNamespace(layers=[layer]))
    dmuon = [types.SimpleNamespace(dmuon_plan=object(), module=model)]  # fp32-style: no Float16Module
    inside = []
    monkeypatch.setattr(megatron_qk_clip, "clip_qk",
                        lambda chunks, log_max_only=False: inside.append((chunks[0].module.module, hasattr(weight, "main_param"))) or 2.0)
    assert clip_qk(dmuon) == 2.0
    assert inside == [(model, False)]  # Megatron's path to the layers; no main_param on the non-owner
    assert weight.main_param is None  # as Megatron left it (its params norm reads it)


@pytest.mark.parametrize("argv,match", [
    (["--tensor-model-parallel-size", "2"], "--qk-clip needs --tensor-model-parallel-size 1"),
    (["--multi-latent-attention"], "--qk-clip with --multi-latent-attention"),
])
def test_the_refusals_come_at_parse_time_under_megatron_lm(argv, match, capsys, monkeypatch):
    import argparse

    from megatron_dmuon.megatron.flags import add_dmuon_args

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    parser = argparse.ArgumentParser(prog="pretrain_gpt.py")  # Megatron-LM's names of the flags read here
    parser.add_argument("--optimizer", default="adam")
    for flag in ("--use-distributed-optimizer", "--qk-clip", "--multi-latent-attention"):
        parser.add_argument(flag, action="store_true")
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1)
    add_dmuon_args(parser)
    base = ["--optimizer", "dmuon", "--use-distributed-optimizer", "--qk-clip"]
    assert parser.parse_args(base).qk_clip  # --qk-clip itself parses
    with pytest.raises(SystemExit):
        parser.parse_args(base + argv)
    assert match in capsys.readouterr().err
