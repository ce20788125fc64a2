"""model.name_or_path as a Hugging Face Hub id: the checkpoint's files brought into the Hub's cache (or found there,
offline) and read from that directory like any local checkpoint, so that everything after validation, transformers
included, sees a directory and never the network. Only what a checkpoint loads from is fetched: its JSON configs,
tokenizer files and one weight format (safetensors, else PyTorch's .bin)."""

from __future__ import annotations

import functools
import re
from pathlib import Path

# org/name (or a legacy bare name such as gpt2): what the Hub accepts as a model repository id
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
CONFIG_AND_TOKENIZER = ["*.json", "*.model", "*.txt", "*.tiktoken"]


class HubError(ValueError):
    """One line: why a hub id gives no checkpoint here, and what to do."""


def looks_like_hub_id(name: str) -> bool:
    return bool(HUB_ID.match(name)) and not Path(name).expanduser().exists()


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _download(repo_id: str, revision: str | None, patterns: list[str]) -> str:
    from huggingface_hub import snapshot_download

    return snapshot_download(repo_id, revision=revision, allow_patterns=patterns)


def _one_line(err: Exception, field: str, repo_id: str, revision: str | None) -> HubError:
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if isinstance(err, GatedRepoError):
        return HubError(f"{field}={repo_id} is gated: accept its terms on huggingface.co, then `hf auth login`")
    if isinstance(err, RevisionNotFoundError):
        return HubError(f"model.revision={revision}: {repo_id} has no such branch, tag or commit on the Hub")
    if isinstance(err, RepositoryNotFoundError):
        return HubError(
            f"{field}={repo_id} is neither a directory nor a model on the Hugging Face Hub (a private one needs "
            "`hf auth login`): give a checkpoint directory or a hub id such as Qwen/Qwen2.5-0.5B"
        )
    if not isinstance(err, LocalEntryNotFoundError):
        first = str(err).splitlines()[0] if str(err) else ""
        return HubError(
            f"{field}={repo_id}: fetching it from the Hugging Face Hub failed: {type(err).__name__}: {first}"
        )
    why = "HF_HUB_OFFLINE=1 is set" if _offline() else "the Hub cannot be reached"
    return HubError(
        f"{field}={repo_id} is not a directory, and the hub model of that id is not in the cache "
        f"({constants.HF_HUB_CACHE}) while {why}: download it where there is network (`hf download {repo_id}`, "
        "with the same HF_HOME) or give the directory save_pretrained() wrote"
    )


@functools.lru_cache(maxsize=16)
def hub_checkpoint(repo_id: str, revision: str | None = None, field: str = "model.name_or_path") -> str:
    """The local snapshot directory of a hub model: fetched where the Hub is reachable, else from the cache.
    Raises HubError (one line) where neither gives it."""
    try:
        path = _download(repo_id, revision, CONFIG_AND_TOKENIZER + ["*.safetensors"])
        if not any(Path(path).glob("*.safetensors")) and not any(Path(path).glob("*.bin")) and not _offline():
            path = _download(repo_id, revision, CONFIG_AND_TOKENIZER + ["*.bin"])  # older checkpoints
    except Exception as err:  # noqa: BLE001 - every failure becomes its one line
        raise _one_line(err, field, repo_id, revision) from err
    return path
