"""Where a stage's model is: a local directory, or a Hugging Face hub id found in the local cache.

    model_dir("models/tiny", None, "stages[0]")                # -> "models/tiny": a directory, as it is
    model_dir("Qwen/Qwen2.5-0.5B", None, "stages[0]")          # -> <cache>/models--Qwen--Qwen2.5-0.5B/snapshots/<commit>
    model_dir("Qwen/Qwen2.5-0.5B", "v1.0", "stages[0]")        # a branch, tag or commit of it (default: main)

A stage's `model` is a directory when one exists at that path; otherwise, if it reads `org/name`, a
hub id, resolved as transformers resolves one with HF_HUB_OFFLINE=1: from the local cache only
(`HF_HUB_CACHE`, else `$HF_HOME/hub`, else ~/.cache/huggingface/hub, as huggingface_hub read them
when imported), never downloaded. The config keeps the snapshot directory it resolves to, so every
loader (model, tokenizer, processor) reads the same files, on any node that sees the same path.
Anything else is a ConfigError naming the value, and for a hub id the cache looked in. Torch-free:
the config reads it; huggingface_hub is imported only for a hub id.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from pipespec.errors import ConfigError

log = logging.getLogger(__name__)

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")  # org/name, as the hub spells repositories


def model_dir(model: str, revision: str | None, where: str) -> str:
    """The directory that holds stage `where`'s `model` (a directory, or a hub id's snapshot in the local
    cache at `revision`, None: main). ConfigError naming `where`.model, or `where`.revision, when there is none."""
    if Path(model).is_dir():
        if revision is not None:
            raise ConfigError(f"{where}.revision: {revision!r} is for a Hugging Face hub id, but {model!r} is a directory")
        return model
    if not HUB_ID.fullmatch(model):
        raise ConfigError(f"{where}.model: model directory {model!r} does not exist (nor is it a Hugging Face hub id, org/name)")
    return _from_cache(model, revision or "main", where)


def _from_cache(repo_id: str, revision: str, where: str) -> str:
    """The snapshot directory of `repo_id` at `revision` in the local Hugging Face cache, looked up offline."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError
    from huggingface_hub.file_download import repo_folder_name

    cache = Path(constants.HF_HUB_CACHE).expanduser()
    try:
        snapshot = snapshot_download(repo_id, revision=revision, cache_dir=cache, local_files_only=True)
    except HFValidationError as e:
        raise ConfigError(f"{where}.model: {repo_id!r} is not a model directory, nor a valid Hugging Face hub id: {e}") from None
    except PermissionError as e:
        raise ConfigError(
            f"{where}.model: {repo_id!r}: the local Hugging Face cache {str(cache)!r} cannot be read: {e}"
        ) from None
    except LocalEntryNotFoundError:
        fetch = f"fetch it first (`hf download {repo_id}{'' if revision == 'main' else f' --revision {revision}'}`)"
        if (cache / repo_folder_name(repo_id=repo_id, repo_type="model")).is_dir():
            raise ConfigError(
                f"{where}.revision: Hugging Face hub id {repo_id!r} is in the local cache {str(cache)!r}, but not its "
                f"revision {revision!r}; {fetch}, or name a revision it has"
            ) from None
        raise ConfigError(
            f"{where}.model: {repo_id!r} is not a model directory, and as a Hugging Face hub id it is not in the local "
            f"cache {str(cache)!r} (HF_HUB_CACHE / HF_HOME; nothing is downloaded); {fetch}, or give the model's directory"
        ) from None
    log.info("%s.model: %s at %s from the Hugging Face cache: %s", where, repo_id, revision, snapshot)
    return snapshot
