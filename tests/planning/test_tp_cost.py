"""planning/tp_cost.py: which TP matrices go distributed Gram, and the time model's direction."""
import pytest

from megatron_dmuon.algorithms.splitting import SplitRule
from megatron_dmuon.planning.tp_cost import choose_tp_method, distributed_gram_eligible, tp_method_costs

FC2 = (3584, 18944)  # Qwen2.5-7B linear_fc2 (row-parallel: partition_dim 1, the long dim)
FC1 = (37888, 3584)  # linear_fc1 (column-parallel: partition_dim 0, the long dim)
PROJ = (3584, 3584)


def test_eligibility():
    assert distributed_gram_eligible(FC2, 1, None, "gram")
    assert distributed_gram_eligible(FC1, 0, None, "auto")
    assert not distributed_gram_eligible(FC2, 0, None, "gram")  # sharded along the short dim
    assert not distributed_gram_eligible(FC2, 1, None, "standard")  # standard NS has no Gram space
    assert not distributed_gram_eligible(PROJ, 1, None, "gram")  # square: Gram NS falls back
    assert not distributed_gram_eligible(FC1, 0, SplitRule("glu"), "gram")  # pieces need gathering
    assert not distributed_gram_eligible(FC1, None, None, "gram")  # replicated


def test_choice_follows_bytes():
    # compute is the same either way; distributed Gram wins while n/m > segments x t / 2
    assert choose_tp_method(FC2, 2, 1, None, "gram") == "distributed_gram"
    assert choose_tp_method(FC2, 8, 1, None, "gram") == "gather"  # 5.3 < 8
    assert choose_tp_method(FC1, 8, 0, None, "gram") == "distributed_gram"  # 10.6 > 8
    assert choose_tp_method(FC2, 2, 1, None, "gram", setting="gather") == "gather"
    assert choose_tp_method(FC2, 1, 1, None, "gram", setting="distributed_gram") == "gather"  # no TP
    costs = tp_method_costs(FC2, 2)
    assert costs["distributed_gram"] < costs["gather"]
    with pytest.raises(ValueError, match="TP method 'scatter' unknown"):  # (the flag's words: the config's check)
        choose_tp_method(FC2, 2, 1, None, "gram", setting="scatter")
