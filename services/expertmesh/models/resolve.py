"""The data plane's settings with the model resolved to files: the embedded tiny model when no source
names one, the domain-trained one (``domain-moe``), or a Hub id resolved to its local snapshot. Kept out of
``config`` so that settings stay settings: resolving may build or download a model."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from expertmesh.config.settings import DataPlaneConfig, settings_from_args
from expertmesh.infra.console import progress

#: ``model`` when no source names a checkpoint: the command line then serves the embedded tiny model
EMBEDDED_MODEL = Path("<embedded tiny model>")


def data_plane_config(args: argparse.Namespace, embedded_default: bool = True) -> DataPlaneConfig:
    """The data plane's settings from every source. A Hub id is resolved here, once, to its local
    snapshot directory: the router and every group it starts then load the same files. Without
    ``embedded_default`` some source must name the model."""
    from expertmesh.models.hub import resolve_model  # imported when a command runs, not when its parser is built

    config = settings_from_args(DataPlaneConfig, args, fallback={"model": EMBEDDED_MODEL} if embedded_default else None)
    if config.model == EMBEDDED_MODEL:
        from expertmesh.models.embedded import default_checkpoint

        progress("using the embedded tiny model (random weights)")
        return config.model_copy(update={"model": default_checkpoint()})
    if str(config.model) == "domain-moe":  # expertmesh.models.domain_moe.ALIAS: trained on first use, then cached
        from expertmesh.models.domain_moe import cached_checkpoint

        print(
            "[expertmesh] using the domain-trained tiny model (training it on first use: a few minutes)",
            flush=True,
            file=sys.stderr,
        )
        return config.model_copy(update={"model": cached_checkpoint(), "model_name": config.model_name or "domain-moe"})
    resolved = resolve_model(str(config.model), config.revision)
    return config.model_copy(update={"model": resolved.path, "model_name": config.model_name or resolved.name})
