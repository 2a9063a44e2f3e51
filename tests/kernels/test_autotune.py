"""The autotune cache (kernels/autotune.py) and a cached kernel choice that fails (kernels/ns_driver.py):
docs/bad_input.md rows 18-20."""
import json
import multiprocessing
import warnings

import pytest
import torch

from megatron_dmuon.kernels import autotune, metrics, ns_driver, symmetric_ops


def test_cache_keys_hold_the_software_versions():
    key = autotune.device_key(torch.device("cpu"))
    assert f"torch{torch.__version__}" in key and "|triton" in key
    assert autotune.CACHE_VERSION >= 3


def test_cache_of_an_older_version_is_ignored_with_a_warning(tmp_path):
    path = tmp_path / "tune.json"
    path.write_text(json.dumps({"version": 2, "entries": {"op|NVIDIA H200|sm90|syrk|m8|k8|b1|float16": {}}}))
    with pytest.warns(RuntimeWarning, match="older version"):
        assert autotune.AutotuneCache(path).entries == {}


def test_a_failing_kernel_choice_falls_back_to_the_torch_path(monkeypatch):
    from megatron_dmuon.algorithms.newton_schulz import newton_schulz

    choice = autotune.OpChoice("triton", autotune.default_config(torch.device("cpu"), 16, 32))
    monkeypatch.setattr(ns_driver, "_FAILED", {})
    monkeypatch.setattr(ns_driver, "fast_path_usable", lambda x, dtype: True)
    monkeypatch.setattr(ns_driver, "shape_plan", lambda *a, **k: autotune.ShapePlan(choice, choice))

    def broken(*a, **k):
        raise RuntimeError("out of resource: shared memory (a cached config this Triton cannot build)")

    monkeypatch.setattr(symmetric_ops, "sym_matmul", broken)
    metrics.reset_nonfinite_metrics()
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(0))
    with pytest.warns(RuntimeWarning, match="runs the torch path from now on"):
        out = ns_driver.newton_schulz_fast(x, compute_dtype=torch.bfloat16)
    assert torch.equal(out, newton_schulz(x, compute_dtype=torch.bfloat16))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once per shape
        ns_driver.newton_schulz_fast(x, compute_dtype=torch.bfloat16)
    assert metrics.nonfinite_metrics()["kernel_fallbacks"] == 2
    with pytest.raises(RuntimeError):  # an explicit backend='triton' is not second-guessed: no fallback
        ns_driver.newton_schulz_fast(x, compute_dtype=torch.bfloat16, backend="triton")


def _write_keys(path, rank, count):
    cache = autotune.AutotuneCache(path)
    for i in range(count):
        cache.put(f"op|gpu|rank{rank}|{i}", {"i": i})


def test_concurrent_writers_keep_every_key(tmp_path):
    path = str(tmp_path / "tune.json")
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_write_keys, args=(path, r, 60)) for r in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0] * 4
    assert len(autotune.AutotuneCache(path).entries) == 240
