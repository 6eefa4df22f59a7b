"""A decode-sized call's (token, expert) rows through a group's experts module, without the stock
forward's per-call mask work.

The stock eager forward of an experts module (``MixtralExperts.forward``, ``GptOssExperts.forward``, ...)
builds a one-hot mask of every slot, sums and searches it for the experts hit, and then loops over
them: per expert, one product over its rows. At a decode step's few rows that bookkeeping costs a
CPU more than the rows' own products (0.45 of a 1.5 ms one-expert call on the project's dev VM).
``rows_forward`` runs the loop alone, over the same shapes with the same operations in the same
order, from the module's own parameters and gate as transformers' experts interface describes the
module (``use_experts_implementation``: ``has_gate``, ``has_bias``, ``is_transposed``,
``has_post_expert_norm``, ``_apply_gate``, ``act_fn``; the description transformers' own
``batched_mm`` and ``grouped_mm`` implementations compute from).

A description is not the module's code: ``matches_stock`` runs both on rows of the loaded weights and
says whether they agree bit for bit. A layer whose module they do not agree on (an architecture whose
eager loop computes another way, a class without the interface) keeps the stock forward.

Glossary
- *row*: one (token, expert) pair of a call, the unit ``HostedExperts.compute`` hands the module
  (each with top-k 1).
- *local expert*: an expert's row in the module's stacked parameters (not its global id).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["rows_forward", "matches_stock"]


def _project(x: torch.Tensor, weight: torch.Tensor, transposed: bool) -> torch.Tensor:
    """x [n, in] through one expert's weight: [in, out] when ``transposed`` (x @ W), else [out, in]."""
    return x @ weight if transposed else nn.functional.linear(x, weight)


def _expert(module: nn.Module, expert: int, x: torch.Tensor) -> torch.Tensor:
    """x [n, H] -> [n, H] through local expert ``expert``, unweighted."""
    transposed = module.is_transposed
    first = "gate_up_proj" if module.has_gate else "up_proj"
    h = _project(x, getattr(module, first)[expert], transposed)  # [n, 2I] or [n, I]
    if module.has_bias:
        h = h + getattr(module, f"{first}_bias")[expert]
    h = module._apply_gate(h) if module.has_gate else module.act_fn(h)  # [n, I]
    out = _project(h, module.down_proj[expert], transposed)  # [n, H]
    if module.has_bias:
        out = out + module.down_proj_bias[expert]
    if module.has_post_expert_norm:
        out = module.post_expert_norm(out)
    return out


def rows_forward(module: nn.Module, hidden: torch.Tensor, local: list[int], weights: torch.Tensor) -> torch.Tensor:
    """hidden [S, H], ``local`` [S] (each row's local expert), weights [S, 1] -> each row through its expert,
    weighted, [S, H]: what ``module(hidden, local as [S, 1], weights)`` returns for rows of top-k 1."""
    out = torch.zeros_like(hidden)  # [S, H]
    for expert in sorted(set(local)):  # the stock loop's order: experts ascending, each one's rows in order
        picked = [i for i, e in enumerate(local) if e == expert]
        if len(picked) == 1:  # the usual decode case: views of the one row, no index tensor to build and gather by
            i = picked[0]
            out[i : i + 1] += (_expert(module, expert, hidden[i : i + 1]) * weights[i : i + 1]).to(out.dtype)
            continue
        rows = torch.tensor(picked, device=hidden.device)  # [n]
        current = _expert(module, expert, hidden[rows]) * weights[rows]  # [n, H]
        out.index_add_(0, rows, current.to(out.dtype))
    return out


def matches_stock(module: nn.Module, hidden_size: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether ``rows_forward`` gives exactly the module's own forward on rows of its loaded weights: three
    rows over its first two local experts (one of them twice), seeded."""
    experts = module.num_experts
    local = [0, min(1, experts - 1), 0]
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(len(local), hidden_size, generator=generator).to(device, dtype)  # [3, H]
    weights = torch.rand(len(local), 1, generator=generator).to(device, dtype)  # [3, 1]
    try:
        with torch.no_grad():
            stock = module(hidden, torch.tensor(local, device=device)[:, None], weights)
            mine = rows_forward(module, hidden, local, weights)
    except Exception:  # not the interface this module describes (a missing attribute, other shapes): never fatal
        return False
    return stock.shape == mine.shape and torch.equal(stock, mine)
