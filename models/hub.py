"""Model paths: a local checkpoint folder, or a Hugging Face Hub id whose files are already cached.

``LLM("Qwen/Qwen3-0.6B")`` works when ``hf download Qwen/Qwen3-0.6B`` (or
``huggingface_hub.snapshot_download``) has put the files in the local Hugging Face cache: the id is
resolved offline (``local_files_only=True``), never downloaded here, so loading never touches the
network. Anything else is a ``CheckpointError`` that says how to get the files.
"""

from __future__ import annotations

import re
from pathlib import Path

from .config import CheckpointError

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def resolve_model_path(model: str | Path) -> Path:
    """The local folder for ``model`` (a folder path or a cached Hub id)."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    name = str(model)
    if path.exists():
        raise CheckpointError(f"{name!r} is a file; give the checkpoint folder (with config.json) instead")
    if not _HUB_ID.match(name):
        raise CheckpointError(f"checkpoint folder {name!r} does not exist or is not a folder")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name, local_files_only=True))
    except ImportError:
        pass
    except Exception:  # not in the cache (LocalEntryNotFoundError), bad id, ...
        pass
    raise CheckpointError(
        f"{name!r} is neither a local folder nor a Hugging Face Hub id in the local cache. Download it "
        f"first: `hf download {name}` (or huggingface_hub.snapshot_download({name!r})), "
        f"then call LLM({name!r}) again, or pass the folder's path")
