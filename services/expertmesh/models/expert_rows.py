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
eager loop computes another way, a class without the interface) keeps the stock forward. Given packed weights
(``linear_kernels.PackedRows`` per stacked weight), the products run on their kernel instead (the same
operations in the same order; the products' last bits are that kernel's).

Glossary
- *row*: one (token, expert) pair of a call, the unit ``HostedExperts.compute`` hands the module
  (each with top-k 1).
- *local expert*: an expert's row in the module's stacked parameters (not its global id).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn

from expertmesh.infra.row_sums import add_rows
from expertmesh.models.checkpoint import interface_forward
from expertmesh.models.linear_kernels import PackedRows

__all__ = ["agrees_with_stock", "matches_stock", "rows_forward"]

#: (module, hidden [S, H], each row's local expert [S], weights [S, 1]) -> weighted rows [S, H]
RowsForward = Callable[[nn.Module, torch.Tensor, list[int], torch.Tensor], torch.Tensor]


def _project(
    module: nn.Module, name: str, expert: int, x: torch.Tensor, packs: Mapping[str, PackedRows] | None
) -> torch.Tensor:
    """x [n, in] through local expert ``expert``'s matrix of the stacked weight ``name``: its packed copy when
    given, else the stored [in, out] when the module is ``is_transposed`` (x @ W), [out, in] otherwise."""
    if packs is not None:
        return packs[name].row(expert).linear(x)
    weight = getattr(module, name)[expert]
    return x @ weight if module.is_transposed else nn.functional.linear(x, weight)


def _expert(
    module: nn.Module, expert: int, x: torch.Tensor, packs: Mapping[str, PackedRows] | None = None
) -> torch.Tensor:
    """x [n, H] -> [n, H] through local expert ``expert``, unweighted."""
    first = "gate_up_proj" if module.has_gate else "up_proj"
    h = _project(module, first, expert, x, packs)  # [n, 2I] or [n, I]
    if module.has_bias:
        h = h + getattr(module, f"{first}_bias")[expert]
    h = module._apply_gate(h) if module.has_gate else module.act_fn(h)  # [n, I]
    out = _project(module, "down_proj", expert, h, packs)  # [n, H]
    if module.has_bias:
        out = out + module.down_proj_bias[expert]
    if module.has_post_expert_norm:
        out = module.post_expert_norm(out)
    return out


def rows_forward(
    module: nn.Module,
    hidden: torch.Tensor,
    local: list[int],
    weights: torch.Tensor,
    packs: Mapping[str, PackedRows] | None = None,
) -> torch.Tensor:
    """hidden [S, H], ``local`` [S] (each row's local expert), weights [S, 1] -> each row through its expert,
    weighted, [S, H]: what ``module(hidden, local as [S, 1], weights)`` returns for rows of top-k 1 (its products
    by ``packs``' kernel when given)."""
    out = torch.zeros_like(hidden)  # [S, H]
    rows_of: dict[int, list[int]] = {}
    for i, e in enumerate(local):
        rows_of.setdefault(e, []).append(i)
    for expert in sorted(rows_of):  # the stock loop's order: experts ascending, each one's rows in order
        picked = rows_of[expert]
        if len(picked) == 1:  # the usual decode case: views of the one row, no index tensor to build and gather by
            i = picked[0]
            out[i : i + 1] += (_expert(module, expert, hidden[i : i + 1], packs) * weights[i : i + 1]).to(out.dtype)
            continue
        rows = torch.tensor(picked, device=hidden.device)  # [n]
        current = _expert(module, expert, hidden[rows], packs) * weights[rows]  # [n, H]
        add_rows(out, rows, current)
    return out


def agrees_with_stock(
    module: nn.Module,
    hidden_size: int,
    forward: RowsForward,
    local: list[int],
    same: Callable[[torch.Tensor, torch.Tensor], bool],
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> bool:
    """Whether ``forward`` (``rows_forward``'s signature) gives the module's own forward by ``same`` (exactly:
    ``torch.equal``; to rounding: ``torch.allclose``) on seeded rows of its loaded weights, one per entry of
    ``local`` (each row's local expert, clamped to the module's). False, never an error, for a module that does
    not compute as transformers' experts interface describes it (a missing attribute, other shapes)."""
    experts = module.num_experts
    local = [min(e, experts - 1) for e in local]
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(len(local), hidden_size, generator=generator).to(device, dtype)  # [S, H]
    weights = torch.rand(len(local), 1, generator=generator).to(device, dtype)  # [S, 1]
    try:
        with torch.no_grad():
            stock = interface_forward(module)(hidden, torch.tensor(local, device=device)[:, None], weights)
            mine = forward(module, hidden, local, weights)
    except Exception:  # not the interface this module describes: never fatal
        return False
    return stock.shape == mine.shape and same(stock, mine)


def matches_stock(module: nn.Module, hidden_size: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether ``rows_forward`` gives exactly the module's own forward: three rows over its first two local
    experts (one of them twice)."""
    return agrees_with_stock(module, hidden_size, rows_forward, [0, 1, 0], torch.equal, dtype, device)
