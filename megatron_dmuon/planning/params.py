"""Which parameters Muon takes, as what matrix, and what orthogonalizing one costs (pure policy).

One rule for the whole package (owner step, planner, references): Muon takes the hidden weight
matrices, i.e. 2-D parameters with both dims >= 2 that are not the embedding or the output
head; everything else (embeddings, output layer, norms, biases, vectors, (n, 1) columns and
N-D tensors) goes to AdamW, as in Megatron's own Muon and Keller's recipe.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from ..algorithms.flops import newton_schulz_flops, ns_method_for
from ..algorithms.gram_newton_schulz import default_restarts

__all__ = ["muon_routing", "param_routing", "is_muon_matrix", "check_muon_matrix_shape", "ns_flops", "ns_cost"]


def muon_routing(name: str, shape: Sequence[int], embedding_or_output: bool = False,
                 use_muon: bool | None = None) -> tuple[bool, str]:
    """``(use_muon, why)`` for a parameter: the one routing rule (see the module docstring).
    ``use_muon=False`` is Megatron's own mark for a matrix its Muon leaves to the scalar
    optimizer (e.g. Mamba's ``in_proj``); DMuon honours it the same way."""
    if use_muon is False:
        return False, "Megatron marks it use_muon=False"
    if embedding_or_output:
        return False, "embedding or output layer (Megatron marks it)"
    if len(shape) != 2:
        return False, f"{len(shape)}-D tensor"
    if min(shape) < 2:
        return False, "a vector or a single row/column"
    lowered = name.lower()
    if "embedding" in lowered or "output_layer" in lowered:
        return False, "embedding or output layer (by name)"
    return True, "hidden weight matrix"


def param_routing(name: str, param: torch.Tensor) -> tuple[bool, str]:
    """``muon_routing`` of a model parameter (Megatron's embedding/output marks included)."""
    marked = getattr(param, "is_embedding_or_output_parameter", False) or getattr(param, "shared_embedding", False)
    return muon_routing(name, param.shape, bool(marked), getattr(param, "use_muon", None))


def is_muon_matrix(name: str, shape: Sequence[int]) -> bool:
    """The rule of ``param_routing`` on a name and a shape (no tensor needed)."""
    return muon_routing(name, shape)[0]


def check_muon_matrix_shape(name: str, shape: Sequence[int]) -> tuple[int, int]:
    """``(rows, cols)`` of a Muon matrix, or a clear error for shapes Muon refuses."""
    shape = tuple(int(s) for s in shape)
    if len(shape) != 2 or min(shape) < 2:
        raise ValueError(
            f"Muon orthogonalizes 2-D matrices with both dims >= 2; {name} has shape {shape}. "
            "Put it in an AdamW param group (vectors, columns and N-D tensors are AdamW's)."
        )
    return shape


def ns_flops(rows: int, cols: int, steps: int = 5, ns_method: str = "auto", *, normalisation: str = "frobenius",
             symmetric: bool = True, restarts: int | None = None) -> float:
    """FLOPs of the NS that runs on one ``rows x cols`` matrix, the one count behind every NS cost
    of the planner: the method ``algorithms.flops.ns_method_for`` picks, Gram with its restarts
    at ``default_restarts(normalisation)`` (``restarts``: that many instead), products with
    symmetric results at half cost as the kernels compute them (``symmetric=False``: full GEMMs)."""
    restart_after = default_restarts(normalisation)
    method = ns_method_for(rows, cols, steps, ns_method, restart_after)
    return float(newton_schulz_flops(rows, cols, steps, method, symmetric, restarts,
                                     restart_after=restart_after if restarts is None else None))


def ns_cost(shape: Sequence[int], steps: int = 5) -> float:
    """Predicted NS cost of one full matrix: FLOPs of the standard iteration (planner's unit)."""
    rows, cols = check_muon_matrix_shape("matrix", shape)
    return ns_flops(rows, cols, steps, "standard", symmetric=False)
