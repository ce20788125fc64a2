"""Tokenized splits reused across runs: a sweep's trials (and reruns) that read the same rows with the same
tokenizer and lengths tokenize them once. Each split is saved with `datasets`' own Arrow format under a key made of
everything its tokens depend on (the rows themselves, the tokenizer's name, class and vocabulary, the lengths and
task), and loaded memory-mapped by the next run. Concurrent trials that miss at once each write to a temporary
folder and the first rename wins; nothing is ever read half-written.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger("memfit")

FORMAT = 1  # bump when the tokenized columns change, so that older caches are not read


def key(rows: list[dict[str, Any]], tokenizer: Any, spec: Any) -> str:
    """What the tokenized split depends on, hashed: the rows, the tokenizer, the lengths, task and template."""
    digest = hashlib.sha256(f"{FORMAT}:{spec}:{type(tokenizer).__name__}:{len(tokenizer)}".encode())
    digest.update(str(getattr(tokenizer, "name_or_path", "")).encode())
    for row in rows:
        if "messages" in row:  # a conversation (memfit.data.chat)
            digest.update(json.dumps(row["messages"], sort_keys=True).encode() + b"\x01")
        else:
            digest.update(row["source"].encode() + b"\x00" + row["target"].encode() + b"\x01")
    return digest.hexdigest()[:24]


def cached(directory: str | None, name: str, make: Callable[[], Any]) -> Any:
    """The dataset saved under `directory/name`, or `make()`'s, saved there for the next run."""
    from datasets import load_from_disk

    if not directory:
        return make()
    path = Path(directory) / name
    if path.exists():
        log.info("tokenized data reused from %s", path)
        return load_from_disk(str(path))
    dataset = make()
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix=f".{name}.", dir=path.parent)
    try:
        dataset.save_to_disk(scratch)
        os.rename(scratch, path)  # atomic; another trial may have renamed its own first
    except OSError:
        shutil.rmtree(scratch, ignore_errors=True)
    return dataset
