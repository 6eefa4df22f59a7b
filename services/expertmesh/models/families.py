"""The MoE model families of the installed transformers, and what the sweep runs of each.

A *family* is a ``transformers/models/<name>`` package whose modeling code
decorates an experts class with ``use_experts_implementation`` (the hook the
router and the expert groups plug into). ``discover`` finds them from the
modeling sources (pure); ``installed_sources`` reads those sources (I/O).

What the sweep builds for a family (its *kind*):
- ``text``: the family's own causal LM (``AutoModelForCausalLM``).
- ``vl-text``: a vision-language family; its text model's causal LM (the text config saved alone).
- ``vl-full``: a vision-language family whose text model has no causal-LM class; only the full
  model (``AutoModelForImageTextToText``) could run it, with a text-only input, which the
  router and groups do not build yet: the sweep reports these unsupported.
- ``none``: neither (an encoder or token classifier, or a config transformers does not register).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal, Mapping

Kind = Literal["text", "vl-text", "vl-full", "none"]
MARKER = "use_experts_implementation"
_MODELING = re.compile(r"^modeling_\w+\.py$")


def discover(sources: Mapping[str, str]) -> list[str]:
    """Family names, sorted, from ``{"<family>/modeling_x.py": source text}``."""
    return sorted(
        {
            path.split("/", 1)[0]
            for path, text in sources.items()
            if _MODELING.match(path.rsplit("/", 1)[-1]) and MARKER in text
        }
    )


def installed_sources() -> dict[str, str]:
    """``{"<family>/modeling_x.py": text}`` for the installed transformers' model packages."""
    import transformers.models

    root = Path(transformers.models.__file__).parent
    return {f"{p.parent.name}/{p.name}": p.read_text(encoding="utf-8") for p in root.glob("*/modeling_*.py")}


def installed_families() -> list[str]:
    return discover(installed_sources())


def classify(family: str, text_type: str | None, causal_lm: set[str], image_text: set[str]) -> Kind:
    """What to run of ``family``: ``text_type`` is its text sub-config's model type (None when the
    config is not composite); ``causal_lm`` / ``image_text`` are the model types transformers maps
    to a causal LM / an image-text-to-text model."""
    if text_type is None:
        return "text" if family in causal_lm else "none"
    if text_type in causal_lm:
        return "vl-text"
    if family in causal_lm or family in image_text:
        return "vl-full"
    return "none"


def kind_of(family: str) -> tuple[Kind, str]:
    """(kind, reason when ``none``) of an installed family."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    if family not in CONFIG_MAPPING:
        return "none", f"transformers registers no config class for {family!r}, so no Auto class can build it"
    config = CONFIG_MAPPING[family]()
    text = config.get_text_config()
    kind = classify(
        family,
        text.model_type if text is not config else None,
        set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES),
        set(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES),
    )
    reason = (
        ""
        if kind != "none"
        else (
            f"transformers maps {type(config).__name__} to no causal-LM or image-text-to-text Auto class "
            "(a token classifier, an omni model, or a causal LM left out of the Auto mapping)"
        )
    )
    return kind, reason
