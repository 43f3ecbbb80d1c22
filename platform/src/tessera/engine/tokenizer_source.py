"""The tokenizer directory a replica publishes for the gateways (``ModelInfo.tokenizer`` in the registry).

A gateway tokenizes prompts itself: it reads ``tokenizer.json``, ``tokenizer_config.json`` and
``chat_template.jinja`` from the directory the model's replicas register (gateway/models.py,
``load_served_model``). A local or ``pvc://`` model names that directory already. A Hugging Face hub id
(``Qwen/Qwen2.5-0.5B-Instruct``) does not: vLLM downloads its files into the Hugging Face cache
(``$HF_HOME/hub/models--Qwen--Qwen2.5-0.5B-Instruct/snapshots/<commit>/``), and that snapshot directory is
what the replica publishes. The Helm chart makes the same path readable in the gateway pods: the shared
hub-cache claim mounted at the same path, or, without one, an init container that fetches these files of the
same repositories into the gateway's own cache (templates/gateway-deployment.yaml).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from huggingface_hub import try_to_load_from_cache

__all__ = ["TOKENIZER_FILES", "published_tokenizer_dir"]

# What the gateway reads of a tokenizer directory, and so what the chart's gateway init container fetches.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def published_tokenizer_dir(tokenizer: str, *, is_dir: Callable[[str], bool] | None = None,
                            cached_file: Callable[[str, str], str | None] | None = None) -> str | None:
    """The directory to publish for the engine's ``tokenizer`` setting (a path or a hub id): the setting
    itself when it is a directory; for a hub id, the cache snapshot that holds its ``tokenizer.json``; None
    when neither is there (a hub id whose tokenizer vLLM did not load as ``tokenizer.json``: the gateways
    cannot tokenize for it). ``is_dir`` and ``cached_file`` are the file-system look-ups (tests pass their own).
    """
    is_dir = is_dir or (lambda path: Path(path).is_dir())
    cached_file = cached_file or _cached_file
    if is_dir(tokenizer):
        return tokenizer
    if tokenizer.startswith(("/", ".")) or "://" in tokenizer:
        return None  # a path that is not there, or a URL: not a hub id
    found = cached_file(tokenizer, TOKENIZER_FILES[0])
    return str(Path(found).parent) if found else None


def _cached_file(repo_id: str, filename: str) -> str | None:
    """The file of the hub repository's default revision in this process's Hugging Face cache ($HF_HOME)."""
    found = try_to_load_from_cache(repo_id, filename)
    return found if isinstance(found, str) else None  # None, or a sentinel for "known not to exist"
