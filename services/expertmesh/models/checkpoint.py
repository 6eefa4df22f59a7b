"""A local HuggingFace MoE checkpoint, read in two parts: the router's part
(everything but the routed experts) and slices of routed experts for a group.

Glossary
- *experts module*: the architecture's own experts class (``MixtralExperts``,
  ``GptOssExperts``, ...), recognised by transformers' ``use_experts_implementation``
  decorator. One per MoE layer; its parameters are stacked over experts
  (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``; transposed and biased for
  GPT-OSS).
- *MoE layer*: a decoder layer (``model.layers.N``) whose MLP holds an experts
  module. Dense layers (DeepSeek-V3's first ones) have none.
- *logical expert*: a ``(layer, expert)`` pair, the unit of placement.
- *target key*: a parameter name of the in-memory model. *Source key*: a tensor
  name in the safetensors files. transformers' own conversion mapping
  (``get_model_conversion_mapping``) maps one to the other, so both the
  per-expert on-disk layout (``experts.E.w1``, ``experts.E.gate_proj``) and the
  fused one (``experts.gate_up_proj``) load through the same code, and an expert
  group applies the same conversion ops to only the experts it hosts.

Nothing here materialises routed-expert weights that the caller did not ask
for: the skeleton is built on the meta device and tensors are read from
memory-mapped safetensors one slice at a time.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import torch
from torch import nn

from expertmesh.contracts.errors import CheckpointError

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class MoESpec:
    """What the platform needs to know about an MoE checkpoint's shape."""

    model_type: str
    num_layers: int
    moe_layers: tuple[int, ...]
    num_experts: int
    top_k: int
    hidden_size: int
    #: parameter names of the experts module stacked over experts, e.g. ("gate_up_proj", "down_proj")
    expert_params: tuple[str, ...]
    #: positions the model supports (max_position_embeddings); None when its config does not say
    max_context: int | None = None
    #: the checkpoint's ``fingerprint`` ("" for a spec not read from a checkpoint)
    fingerprint: str = ""

    def all_experts(self) -> list[tuple[int, int]]:
        return [(layer, e) for layer in self.moe_layers for e in range(self.num_experts)]


@dataclass
class _Target:
    """How to build one in-memory parameter from checkpoint tensors.

    ``sources[pattern][index] = (file, key)``; ``index`` is the expert (``*``)
    number for per-expert layouts and ``None`` for a tensor stored whole.
    """

    key: str
    converter: object | None = None
    sources: dict[str, dict[int | None, tuple[str, str]]] = field(default_factory=dict)


def experts_modules(model: nn.Module) -> dict[int, tuple[str, nn.Module]]:
    """Map layer index -> (module name, experts module) for every MoE layer of ``model``."""
    found: dict[int, tuple[str, nn.Module]] = {}
    for name, module in model.named_modules():
        # set by transformers' use_experts_implementation decorator
        if hasattr(module, "_is_expert_parallel") and hasattr(module, "num_experts"):
            match = _LAYER_RE.search(name + ".")
            if match is None:
                raise CheckpointError(f"experts module {name!r} is not under a numbered decoder layer")
            found[int(match.group(1))] = (name, module)
    return found


def interface_forward(module: nn.Module) -> Callable[..., torch.Tensor]:
    """``module``'s forward as transformers' experts interface runs it: that of the class its
    ``use_experts_implementation`` decorated, bound to ``module``. A subclass may wrap work around that call
    (Ergo's experts give each route a row of its own, norm each expert's output by a per-expert weight, and sum
    the routes): stock code that runs on the router, around the dispatch that takes the interface's place. A
    group computes what the interface does, no more; its own forward would do that work a second time."""
    for cls in type(module).__mro__:
        forward = cls.__dict__.get("forward")
        code = getattr(forward, "__code__", None)  # the decorator's wrapper, whose name wraps() did not copy
        if code is not None and "use_experts_implementation" in code.co_qualname:
            return forward.__get__(module)
    raise CheckpointError(f"{type(module).__name__} is not an experts class of transformers' experts interface")


def _targets_of(target_key: str, converter) -> list[str]:
    """Every parameter a converted source tensor feeds: one, or all the pieces of a split
    (Lara-Mini's fused ``in_proj`` -> ``in_proj_qkv``, ``in_proj_z``, ...)."""
    patterns = list(getattr(converter, "target_patterns", ()))
    mine = max((p for p in patterns if p in target_key), key=len, default=None)
    if len(patterns) < 2 or mine is None:
        return [target_key]
    return [target_key.replace(mine, p, 1) for p in patterns]


def _expert_index(pattern: str, key: str) -> int | None:
    """The expert number of ``key`` under a per-expert source ``pattern``: a regex in which an
    unescaped ``*`` stands for the number (``.experts.*.w1.weight``, ``\\.experts.*.w1.weight``).
    None for a tensor stored whole."""
    star, count = re.subn(r"(?<!\\)\*", r"(?P<expert>\\d+)", pattern)
    match = re.search(star, key) if count == 1 else None
    return int(match.group("expert")) if match else None


#: config.json keys that say where or how a checkpoint was written, not what model it is
_UNIDENTIFYING_KEYS = ("_name_or_path", "transformers_version", "torch_dtype", "dtype")
#: bytes of tensor data read from the start of each weight file: tells checkpoints of one shape apart
_FINGERPRINT_SAMPLE = 1 << 16


def fingerprint(path: Path, weight_files: list[str]) -> str:
    """16 hex digits that differ between checkpoints that are different models, the same wherever a
    copy is mounted: the config (less the keys that only say how it was saved), and per weight file
    its name, size, safetensors header (every tensor's name, dtype, shape) and first 64 KiB of data.
    Cheap (no full read), so every router, group and orchestrator computes it at start."""
    import hashlib
    import struct

    digest = hashlib.sha256()
    config = json.loads((path / "config.json").read_text())
    for key in _UNIDENTIFYING_KEYS:
        config.pop(key, None)
    digest.update(json.dumps(config, sort_keys=True).encode())
    for name in weight_files:
        file = path / name
        digest.update(f"{name}:{file.stat().st_size}".encode())
        with open(file, "rb") as f:
            header = f.read(8)
            digest.update(f.read(struct.unpack("<Q", header)[0] + _FINGERPRINT_SAMPLE if len(header) == 8 else 0))
    return digest.hexdigest()[:16]


class Checkpoint:
    """A local checkpoint directory: ``config.json`` plus safetensors (single or sharded)."""

    def __init__(self, path: str | Path):
        from safetensors import SafetensorError, safe_open
        from transformers import AutoConfig

        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"checkpoint directory {self.path} does not exist")
        if not (self.path / "config.json").is_file():
            raise CheckpointError(
                f"{self.path} has no config.json; point --model at a HuggingFace checkpoint directory"
            )
        try:
            self.config = AutoConfig.from_pretrained(self.path, local_files_only=True)
        except (ValueError, OSError, json.JSONDecodeError) as err:
            raise CheckpointError(f"cannot read {self.path / 'config.json'}: {err}") from None

        self._files: dict[str, object] = {}
        for file in self._weight_files():
            try:
                self._files[file] = safe_open(str(self.path / file), framework="pt")
            except (SafetensorError, OSError) as err:
                raise CheckpointError(f"{self.path / file} is truncated or not a safetensors file ({err})") from None

        skeleton = self._skeleton = self.skeleton()
        moe = experts_modules(skeleton)
        if not moe:
            raise CheckpointError(
                f"{self.path} ({self.config.model_type}) has no MoE layers that use transformers' experts "
                "interface; expertmesh serves Mixture-of-Experts models only"
            )
        first_name, first = next(iter(moe.values()))
        expert_params = tuple(
            name
            for name, p in first.named_parameters(recurse=False)
            if p.dim() >= 1 and p.shape[0] == first.num_experts
        )
        text_config = self.config.get_text_config()
        self.total_parameters = sum(p.numel() for p in skeleton.parameters())
        self.parameters_per_expert = sum(getattr(first, name).numel() for name in expert_params) // first.num_experts
        self.spec = MoESpec(
            model_type=self.config.model_type,
            num_layers=text_config.num_hidden_layers,
            moe_layers=tuple(sorted(moe)),
            num_experts=first.num_experts,
            top_k=int(getattr(text_config, "num_experts_per_tok", 0) or getattr(text_config, "top_k", 0)),
            hidden_size=text_config.hidden_size,
            expert_params=expert_params,
            max_context=getattr(text_config, "max_position_embeddings", None),
            fingerprint=fingerprint(self.path, self._weight_files()),
        )
        self._expert_keys = {f"{name}.{p}": layer for layer, (name, _) in moe.items() for p in expert_params}
        self._targets = self._map_keys(skeleton)
        missing = [k for k in skeleton.state_dict() if k not in self._targets and not self._is_tied(skeleton, k)]
        if missing:
            raise CheckpointError(f"{self.path} lacks weights for {len(missing)} parameters, e.g. {missing[:3]}")

    # -- reading -----------------------------------------------------------------

    def _weight_files(self) -> list[str]:
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as err:
                raise CheckpointError(f"{index} is not a safetensors index: {err}") from None
            files = sorted(set(weight_map.values()))
            absent = [f for f in files if not (self.path / f).is_file()]
            if absent:
                raise CheckpointError(f"{index} names shards that are missing: {absent}")
            return files
        files = sorted(p.name for p in self.path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{self.path} has no .safetensors weights (other formats are not supported)")
        return files

    def skeleton(self, experts_implementation: str = "eager", dtype: torch.dtype | None = None) -> nn.Module:
        """The full model on the meta device: shapes and module tree, no memory."""
        from transformers import AutoModelForCausalLM

        # A copy: the experts implementation is stored on the config, and a router and a
        # group built in one process must not switch each other's.
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(
                copy.deepcopy(self.config), experts_implementation=experts_implementation, dtype=dtype or torch.float32
            )

    @staticmethod
    def _is_tied(model: nn.Module, key: str) -> bool:
        return key in getattr(model, "all_tied_weights_keys", {})

    def _map_keys(self, skeleton: nn.Module) -> dict[str, _Target]:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, rename_source_key

        transforms = get_model_conversion_mapping(skeleton)
        converters = [t for t in transforms if isinstance(t, WeightConverter)]
        renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
        by_pattern = {p: c for c in converters for p in c.source_patterns}
        meta_state = skeleton.state_dict()
        targets: dict[str, _Target] = {}
        for file, handle in self._files.items():
            for key in handle.keys():
                target_key, pattern = rename_source_key(
                    key, renamings, converters, skeleton.base_model_prefix, meta_state
                )
                if target_key not in meta_state and key in meta_state:
                    # a renaming meant for another module's key (DeepSeek-V4's ".norm." -> ".kv_norm.")
                    # caught a name the model already uses: transformers keeps it as it is too
                    target_key, pattern = key, None
                if target_key not in meta_state:
                    continue  # e.g. an lm_head tied to the embeddings, or a key of another head
                index = None if pattern is None else _expert_index(pattern, key)
                for sibling in _targets_of(target_key, by_pattern.get(pattern)):
                    target = targets.setdefault(sibling, _Target(sibling, by_pattern.get(pattern)))
                    target.sources.setdefault(pattern or "", {})[index] = (file, key)
        return targets

    def _read(self, file: str, key: str) -> torch.Tensor:
        return self._files[file].get_tensor(key)

    def _materialize(self, target: _Target, experts: list[int] | None = None) -> torch.Tensor:
        """Build one parameter; for an expert parameter only ``experts`` (global ids, in order)."""
        if target.converter is None:
            ((file, key),) = target.sources[""].values()
            if experts is None:
                return self._read(file, key)
            whole = self._files[file].get_slice(key)
            return torch.cat([whole[e : e + 1] for e in experts], dim=0)
        # Patterns this checkpoint has: a converter may also list optional ones (quantisation scales).
        present = [p for p in target.converter.source_patterns if p in target.sources]
        if all(set(target.sources[p]) == {None} for p in present):
            # A fused tensor converted whole (e.g. Inkling 2's interleaved w13): convert, then take rows.
            whole = self._convert(target, {p: [self._read(*target.sources[p][None])] for p in present})
            return whole if experts is None else whole[experts]
        collected: dict[str, list[torch.Tensor]] = {}
        for pattern in present:
            by_index = target.sources[pattern]
            wanted = experts if experts is not None else sorted(i for i in by_index if i is not None)
            absent = [i for i in wanted if i not in by_index]
            if absent:
                raise CheckpointError(f"{self.path}: no tensor for {pattern!r} of experts {absent} ({target.key})")
            collected[pattern] = [self._read(*by_index[i]) for i in wanted]
        return self._convert(target, collected)

    def _convert(self, target: _Target, collected: dict[str, list[torch.Tensor]]) -> torch.Tensor:
        """Apply ``target``'s conversion ops to its source tensors, as transformers does on load."""
        converter = target.converter
        # A split names its pieces after the first target's full name, as transformers' loader does.
        first = _targets_of(target.key, converter)[0]
        for op in converter.operations:
            collected = op.convert(
                collected,
                source_patterns=converter.source_patterns,
                target_patterns=converter.target_patterns,
                full_layer_name=first,
                config=self.config,
                model=self._skeleton,  # a split sizes its pieces by the model's (meta) parameters
                missing_keys=None,
            )
        if len(collected) == 1:
            (tensor,) = collected.values()
            return tensor
        # a split: the piece whose target pattern names this parameter
        return collected[max((p for p in collected if p in target.key), key=len)]

    # -- the two halves ----------------------------------------------------------

    def non_expert_state(self, dtype_of: dict[str, torch.dtype]) -> dict[str, torch.Tensor]:
        """Every weight except routed experts, keyed by in-memory name, cast to ``dtype_of[key]``."""
        return {
            key: self._materialize(target).to(dtype_of[key])
            for key, target in self._targets.items()
            if key not in self._expert_keys and key in dtype_of
        }

    def expert_storage(self) -> str:
        """How routed experts are stored on disk: ``per-expert`` tensors (``experts.E.w1``) merged on
        load, or ``stacked`` ones (``experts.gate_up_proj``), with the conversion's op names."""
        target = self._targets[next(iter(self._expert_keys))]
        if target.converter is None:
            return "stacked"
        per_expert = any(i is not None for sources in target.sources.values() for i in sources)
        ops = "+".join(type(op).__name__ for op in target.converter.operations)
        return f"{'per-expert' if per_expert else 'stacked'} ({ops})"

    def expert_weights(self, layer: int, experts: Iterable[int], dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The experts module parameters of ``layer`` for ``experts`` only.

        Returns ``{param: tensor [len(experts), ...]}`` in the order given.
        """
        experts = list(experts)
        if layer not in self.spec.moe_layers:
            raise CheckpointError(
                f"layer {layer} is not an MoE layer of {self.path} (MoE layers: {list(self.spec.moe_layers)})"
            )
        bad = [e for e in experts if not 0 <= e < self.spec.num_experts]
        if bad:
            raise CheckpointError(f"experts {bad} do not exist in layer {layer} ({self.spec.num_experts} experts)")
        out = {}
        for key, key_layer in self._expert_keys.items():
            if key_layer == layer:
                param = key.rsplit(".", 1)[1]
                out[param] = self._materialize(self._targets[key], experts).to(dtype)
        return out
