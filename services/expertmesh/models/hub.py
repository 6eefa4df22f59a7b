"""Hugging Face Hub model ids (``--model ORG/NAME [--revision R]``) resolved to local snapshots.

The local Hub cache comes first (``HF_HUB_CACHE``, ``HF_HOME``); a model not there is downloaded
unless ``HF_HUB_OFFLINE`` is set, and then the error says how to fetch it. The command that starts
a deployment resolves once and hands the snapshot directory on, so the router and every expert
group load the same files even if the branch moves meanwhile.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from expertmesh.contracts.errors import CheckpointError

#: ORG/NAME as the Hub spells repository ids
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
#: what serving needs from a repository: config, safetensors weights, tokenizer and chat template
SERVING_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]


@dataclass(frozen=True)
class ResolvedModel:
    path: Path  # a local checkpoint directory
    name: str | None = None  # the Hub id, when the model came from the Hub


def resolve_model(model: str, revision: str | None = None, cache_dir: Path | None = None) -> ResolvedModel:
    """A local directory as it is; ``ORG/NAME`` to its snapshot in the Hub cache (downloaded when
    missing and online). Anything else is returned unchanged for ``Checkpoint`` to report."""
    path = Path(model)
    if path.exists() or not HUB_ID.fullmatch(model):
        if revision is not None:
            raise CheckpointError(f"--revision applies to Hub ids (ORG/NAME); {model} is a local path")
        return ResolvedModel(path)
    from huggingface_hub import is_offline_mode, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    fetch = f"hf download {model}" + (f" --revision {revision}" if revision else "")
    at = f"{model}" + (f"@{revision}" if revision else "")
    try:
        snapshot = snapshot_download(model, revision=revision, cache_dir=cache_dir, local_files_only=True)
    except LocalEntryNotFoundError:
        if is_offline_mode():
            raise CheckpointError(
                f"{at} is not in the local Hub cache and HF_HUB_OFFLINE is set: fetch it first with `{fetch}`"
            ) from None
    else:
        return ResolvedModel(Path(snapshot), model)
    try:
        snapshot = snapshot_download(model, revision=revision, cache_dir=cache_dir, allow_patterns=SERVING_FILES)
    except (RepositoryNotFoundError, GatedRepoError) as err:
        raise CheckpointError(
            f"{at}: the Hub has no such model, or it needs a token (HF_TOKEN): {type(err).__name__}"
        ) from None
    except RevisionNotFoundError:
        raise CheckpointError(f"{model} has no revision {revision!r} on the Hub") from None
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise CheckpointError(f"cannot download {at} from the Hub ({first}): fetch it with `{fetch}`") from None
    return ResolvedModel(Path(snapshot), model)
