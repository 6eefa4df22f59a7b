"""Biasing the stock gate's scores before its own top-k, for every architecture.

Each MoE block's gate (``MixtralTopKRouter``, ``DeepseekV3TopkRouter``,
``GptOssTopKRouter``, ...) computes its logits with one ``F.linear`` and then
applies the architecture's own selection (softmax or sigmoid, group-limited
top-k, renormalisation, scaling). Adding a bias to that linear's output steers
selection while every later step stays the architecture's: a bias of ``-inf`` on
an expert makes the gate choose the next-best expert in its slot (how a
quarantined expert with no healthy replica is routed around), and a finite bias
per token is what a routing policy needs.

The bias is added by a ``TorchFunctionMode`` entered only around the forward of
a gate whose layer has a bias set (none set: no mode, the stock forward runs
untouched). The router model's forwards run one at a time (the serving engine's
thread, or a stock forward outside any step), so the step's routing is this
object's for the duration of ``routing``.

Two sources of bias add up: ``set`` (the whole router's, per layer: quarantined
experts) and ``routing`` (one forward's per-token routing policies,
``routing_policy.StepRouting``); a step's ``gate_temperature`` divides the same
logits first, and ``noisy_topk``'s noise then ``sticky``'s bias (computed token by
token from those logits, ``token_rules.sticky_scan``) are added last. A step with
k rules (``delta_gap``, ``dynamic_k``, ``decay_k``, ``confidence_k``,
``adaptive_k``) or ``capacity`` also has the gate's top-k transformed after its
forward: every
gate class keeps ``top_k`` and returns ``(logits, weights, index)``, so the
tokens that need another k are gated once more with that ``top_k``, by the
architecture's own selection (and the same logits transform), and capacity
then moves the overflow.

Sigmoid gates (DeepSeek-V3) select on ``sigmoid(logit) + correction bias``: an
expert at ``-inf`` has score 0 and may still be among the top-k when its
correction bias is large, with routing weight 0; the dispatch plan drops such
slots, so the output is the same as if it had not been chosen.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator, Mapping

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from expertmesh.models.checkpoint import experts_modules
from expertmesh.router.policy.routing_policy import (
    StepRouting,
    apply_k_rules,
    capacity_route,
    gate_scores,
    temper,
    token_k,
    top2_gap,
)
from expertmesh.router.policy.token_rules import gate_confidence, gumbel_noise, sticky_scan


class _BiasFirstLinear(TorchFunctionMode):
    """Transforms the output of the first ``F.linear`` it sees, the gate's logits: divided by
    ``temperature`` ([T]; 1: untouched) first, then plus ``bias`` ([E] or [T, E]), then ``then`` (logits
    [T, E'] -> logits: noise and sticky)."""

    def __init__(
        self,
        bias: torch.Tensor | None,
        temperature: torch.Tensor | None = None,
        then: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ):
        super().__init__()
        self._bias = bias
        self._temperature = temperature
        self._then = then
        self._done = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is F.linear and not self._done:
            self._done = True
            if self._temperature is not None:
                out = temper(out, self._temperature)
            if self._bias is not None:
                bias = self._bias.to(out.device, out.dtype)
                if out.shape[-1] == bias.shape[-1] + 1:  # a skip class after the experts (Zaya): left as it is
                    bias = F.pad(bias, (0, 1))
                out = out + bias
            if self._then is not None:
                out = self._then(out)
        return out


def _gate_in(child: nn.Module, num_experts: int) -> nn.Module | None:
    """The module to hook for the logits in ``child`` (None: ``child`` is no gate): ``child`` itself
    when its first linear gives them (a linear, HunYuan's ``gate.wg``, AFMoE's ``router.gate``), else
    the linear that does (Zaya's router runs an MLP first). Logits are [E] or [E + 1] (a skip class)."""
    linears = [
        m for m in child.modules() if isinstance(getattr(m, "weight", None), torch.Tensor) and m.weight.dim() == 2
    ]
    logits = [m for m in linears if m.weight.shape[0] in (num_experts, num_experts + 1)]
    if not logits:
        return None
    return child if linears[0] is logits[0] else logits[0]


def find_gates(model: nn.Module) -> dict[int, nn.Module]:
    """layer -> the gate of its MoE block: the first of the block's children (the experts aside) that
    holds a [num_experts, hidden] linear; see ``_gate_in`` for which module of it is hooked."""
    gates = {}
    for layer, (name, experts) in experts_modules(model).items():
        block = model.get_submodule(name.rsplit(".", 1)[0])
        for child in block.children():
            gate = None if child is experts else _gate_in(child, experts.num_experts)
            if gate is not None:
                gates[layer] = gate
                break
        else:
            raise ValueError(f"layer {layer}: no gate with a [{experts.num_experts}, hidden] weight in {name}'s block")
    return gates


def _add_rows(logits: torch.Tensor, rows: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
    """logits [T, E'] with ``extra`` [R, E] added to the first E columns of ``rows`` [R]; other rows bit for bit."""
    out = logits.clone()
    E = extra.shape[1]
    out[rows, :E] = logits[rows, :E] + extra.to(logits.device, logits.dtype)
    return out


def widest_k(gate: nn.Module, num_experts: int) -> int:
    """The most experts ``gate`` can choose per token: group-limited gates (DeepSeek-V3) choose only
    within their ``topk_group`` best groups."""
    groups = getattr(gate, "n_group", None)
    if groups:
        return num_experts // groups * gate.topk_group
    return num_experts


class GateBias:
    """Per MoE layer, a bias on the gate's logits; ``set`` swaps the whole map in one assignment."""

    def __init__(self, model: nn.Module):
        self._biases: Mapping[int, torch.Tensor] = {}
        #: the routing of the forward running now (``routing``), and the mode entered around its current gate
        self._step: StepRouting | None = None
        self._mode: _BiasFirstLinear | None = None
        self.gates = find_gates(model)
        experts = experts_modules(model)
        self.num_experts = {layer: experts[layer][1].num_experts for layer in self.gates}
        config_k = getattr(getattr(model, "config", None), "num_experts_per_tok", None) or 1
        #: the experts each gate chooses per token (sticky's trace follows that many)
        self.top_k = {layer: int(getattr(gate, "top_k", None) or config_k) for layer, gate in self.gates.items()}
        #: the noise and sticky bias [T, E] the running forward's gate at that layer added (for ``_gate_again``)
        self._added: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for layer, gate in self.gates.items():
            gate.register_forward_pre_hook(lambda _m, _a, layer=layer: self._enter(layer))
            gate.register_forward_hook(lambda *_: self._exit(), always_call=True)
            gate.register_forward_hook(lambda _m, args, out, layer=layer: self._k_rules(layer, args, out))

    @contextmanager
    def routing(self, step: StepRouting | None) -> Iterator[None]:
        """Within this block, the model's forward applies ``step``'s per-token policies (None: none)."""
        self._step = step
        self._added = {}
        try:
            yield
        finally:
            self._step = None
            self._added = {}

    def set(self, biases: Mapping[int, torch.Tensor]) -> None:
        """layer -> bias [num_experts] (or [tokens, num_experts]) from the next gate forward on."""
        self._biases = dict(biases)

    def biases(self) -> Mapping[int, torch.Tensor]:
        return self._biases

    def _bias(self, layer: int) -> torch.Tensor | None:
        """The bias [E] or [T, E] of ``layer``'s gate in the forward running, or None."""
        bias = self._biases.get(layer)
        step = self._step
        extra = step.biases.get(layer) if step is not None else None
        if extra is None:
            return bias
        return extra if bias is None else extra + bias

    def _temperature(self) -> torch.Tensor | None:
        """The per-token tau [T] of the forward running, or None."""
        step = self._step
        return step.temperature if step is not None else None

    def _enter(self, layer: int) -> None:
        bias, temperature = self._bias(layer), self._temperature()
        step = self._step
        then = None
        if step is not None and (step.noise is not None or step.sticky):
            then = lambda logits: self._noise_and_sticky(layer, logits)  # noqa: E731
        mode = None
        if bias is not None or temperature is not None or then is not None:
            mode = _BiasFirstLinear(bias, temperature, then)
            mode.__enter__()
        self._mode = mode

    def _noise_and_sticky(self, layer: int, logits: torch.Tensor) -> torch.Tensor:
        """The gate's logits [T, E'] (temperature and bias applied) plus noisy_topk's noise and sticky's bias
        on the rows that have them; what was added is kept for ``_gate_again``."""
        step, E = self._step, self.num_experts[layer]
        added = torch.zeros(logits.shape[0], E)
        touched = torch.zeros(logits.shape[0], dtype=torch.bool)
        if step.noise is not None:
            rows = (step.noise.scale > 0).nonzero().squeeze(1)  # [R]
            noise = gumbel_noise(step.noise.seed[rows], step.noise.t[rows], layer, E)  # [R, E]
            added[rows] = noise * step.noise.scale[rows, None]
            touched[rows] = True
            logits = _add_rows(logits, rows, added[rows])
        if step.sticky:
            bias = sticky_scan(logits[:, :E], step.sticky, layer, self.top_k[layer]).cpu()  # [T, E]
            rows = torch.cat([torch.arange(s.start, s.end) for s in step.sticky])
            added[rows] = added[rows] + bias[rows]
            touched[rows] = True
            logits = _add_rows(logits, rows, bias[rows])
        self._added[layer] = (touched, added)
        return logits

    def _exit(self) -> None:
        mode = self._mode
        if mode is not None:
            self._mode = None
            mode.__exit__(None, None, None)

    def _k_rules(self, layer: int, args: tuple, out: tuple) -> tuple | None:
        """The gate's (logits [T, E], weights, index [T, K]) after the step's k rules and capacity; None:
        unchanged."""
        step = self._step
        if step is None or (step.k_rules is None and step.capacity is None):
            return None
        if not (isinstance(out, tuple) and len(out) == 3):
            return None  # a gate of another shape (verified families all return the triple) keeps its top-k
        gate, num_experts = self.gates[layer], self.num_experts[layer]
        logits, weights, index = out
        sigmoid = hasattr(gate, "e_score_correction_bias")
        scores = gate_scores(logits, sigmoid=sigmoid)  # [T, E] (E + 1 with a skip class)
        if step.k_rules is not None:
            rules = step.k_rules
            gap = top2_gap(scores)  # [T]
            top_k = getattr(gate, "top_k", index.shape[1])
            confidence = gate_confidence(scores[:, :num_experts]) if rules.needs_confidence else None  # [T]
            k = token_k(gap, rules, top_k, widest_k(gate, num_experts), confidence)  # [T]
            if not hasattr(gate, "top_k"):  # a gate that cannot be asked for another k keeps its own
                k = torch.full_like(k, top_k)
            regated = []
            for some_k in sorted(set(k.tolist()) - {top_k}):
                rows = (k == some_k).nonzero().squeeze(1)  # [W]
                regated.append((rows, *self._gate_again(gate, layer, args[0], logits.shape[0], rows, some_k)))
            index, weights = apply_k_rules(index, weights, gap, rules, num_experts, regated)
        if step.capacity is not None:
            rank = scores[:, :num_experts]
            correction = getattr(gate, "e_score_correction_bias", None)
            if correction is not None:  # DeepSeek-V3 selects on the score plus its correction bias
                rank = rank + correction.float().to(rank.device)
            rank = rank.masked_fill(~torch.isfinite(logits[:, :num_experts].float()), float("-inf"))
            normalised = bool(getattr(gate, "norm_topk_prob", True))
            index, weights = capacity_route(index, weights, scores[:, :num_experts], rank, step.capacity, normalised)
        return logits, weights, index

    def _gate_again(self, gate: nn.Module, layer: int, hidden: torch.Tensor, tokens: int, rows: torch.Tensor, k: int):
        """The gate's own (index [W, k], weights [W, k]) for the tokens ``rows`` [W] of its input ``hidden``,
        with the forward's bias, temperature, noise and sticky bias on those rows."""
        hidden = hidden.reshape(tokens, -1)[rows]  # [W, H]
        bias, temperature = self._bias(layer), self._temperature()
        if bias is not None and bias.dim() == 2:
            bias = bias[rows]
        if temperature is not None:
            temperature = temperature[rows]
        then = None
        if layer in self._added:
            touched, added = self._added[layer]
            mine = touched[rows.cpu()].nonzero().squeeze(1)  # [W'] of the W rows
            extra = added[rows.cpu()][mine]  # [W', E]
            then = lambda logits: _add_rows(logits, mine, extra)  # noqa: E731
        old_k = gate.top_k
        gate.top_k = k
        try:
            if bias is None and temperature is None and then is None:
                _, weights, index = gate.forward(hidden)
            else:
                with _BiasFirstLinear(bias, temperature, then):
                    _, weights, index = gate.forward(hidden)
        finally:
            gate.top_k = old_k
        return index, weights


def masked(num_experts: int, experts: frozenset[int]) -> torch.Tensor:
    """A bias [num_experts] that keeps ``experts`` from being chosen: -inf on them, 0 elsewhere."""
    bias = torch.zeros(num_experts)
    bias[sorted(experts)] = float("-inf")
    return bias
