import megatron_dmuon


def test_package_imports():
    assert megatron_dmuon.__version__
