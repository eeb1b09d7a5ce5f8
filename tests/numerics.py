"""Test tolerances derived from floating-point rounding, not from one machine's results.

A reduction of n terms in a floating type errs by at most about n * eps times the magnitude of
its terms (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., 4.2: gamma_{n-1} times
sum |x_i|), whatever order the kernel adds them in: AVX-512, AVX2 or the scalar
``ATEN_CPU_CAPABILITY=default`` path, one thread or several. A bound written as
``rounding_bound(n, scale)`` therefore holds on any x86-64 CPU, where a figure that happened to
pass on one machine fails on the next. Where two float32 paths that round differently are
compared, each is compared with a float64 reference (whose own error is ~1e-16, negligible).
"""

from __future__ import annotations

import os

import torch


def rounding_bound(num_terms: int, scale: float, dtype: torch.dtype = torch.float32) -> float:
    """``eps(dtype) * num_terms * scale``: the forward error of a ``num_terms``-term reduction.

    ``num_terms`` is the length of the reductions on the path (summed where one feeds the next);
    ``scale`` is the magnitude of the values reduced (the largest |exact result| where the terms
    do not cancel, the terms' own magnitude where they do).
    """
    return torch.finfo(dtype).eps * num_terms * scale


def max_abs_diff(got: torch.Tensor, exact: torch.Tensor) -> float:
    """The largest |got - exact|, computed in float64 so the comparison adds no rounding."""
    return float((got.double() - exact.double()).abs().max()) if got.numel() else 0.0


def assert_within(err: float, bound: float, what: str) -> None:
    """Assert ``err < bound``, naming both; with ``NUMERICS_LOG=<file>`` set, also append them there
    (how the measured errors against their bounds are gathered across CPUs and thread counts)."""
    log = os.environ.get("NUMERICS_LOG")
    if log:
        with open(log, "a") as f:
            f.write(f"{what}\t{err:.3e}\t{bound:.3e}\n")
    assert err < bound, f"{what}: error {err:.3e} is not below its bound {bound:.3e}"


def gpt_forward_terms(model: dict, seq_len: int) -> int:
    """The reduction lengths along one forward of a dense GPT (the n of ``rounding_bound``).

    Per layer: RMSNorm, QKV, q.k over a head, softmax and p.v over the sequence, the output
    projection, RMSNorm, fc1 and fc2; then the final norm, the output layer and the softmax over
    the vocabulary. ``model``: ModelConfig keyword arguments (num_layers, hidden_size, ...).
    """
    hidden, ffn = model["hidden_size"], model["ffn_hidden_size"]
    head_dim = hidden // model["num_attention_heads"]
    return model["num_layers"] * (6 * hidden + head_dim + 2 * seq_len + ffn) + 2 * hidden + model["vocab_size"]


def assert_close_within(got: torch.Tensor, exact: torch.Tensor, bound: float, what: str) -> None:
    """``assert_within(max_abs_diff(got, exact), bound, what)`` after checking that the shapes agree."""
    assert got.shape == exact.shape, f"{what}: shape {tuple(got.shape)} is not {tuple(exact.shape)}"
    assert_within(max_abs_diff(got, exact), bound, what)


def group_advantage_bound(groups: list[torch.Tensor], width: int, norm: bool) -> float:
    """Two float32 paths to GRPO's (s - mean) / (std + eps) differ by at most this.

    ``groups``: each group's scores in float64, s being a row's sum over ``width`` tokens. s - mean
    errs by eps * (width + k + 1) * max|s| (k = the group's size); std by eps * (width + 2k + 4) * max|s|,
    which moves a = (s - mean) / std by |a| times that over std. With ``norm`` False only s - mean.
    A group of equal scores has std 0 and gives exactly 0 on both paths. Both paths: twice the sum.
    """
    eps, bound = torch.finfo(torch.float32).eps, 0.0
    for scores in groups:
        k, top = scores.numel(), float(scores.abs().max())
        std = float(scores.std()) if k > 1 else 1.0  # a group of one divides by 1
        centred = eps * (width + k + 1) * top
        if norm and std > 0:
            a_max = float((scores - (scores.mean() if k > 1 else 0.0)).abs().max()) / std
            centred = (centred + a_max * eps * (width + 2 * k + 4) * top) / std + eps * a_max
        bound = max(bound, 2 * centred)
    return bound
