"""The tokenizer directory a replica publishes for the gateways (tokenizer_source.py): a path as given, a
hub id as its snapshot in the Hugging Face cache (the layout huggingface_hub itself reads)."""

from __future__ import annotations

from pathlib import Path

from huggingface_hub import try_to_load_from_cache

from tessera.engine.tokenizer_source import published_tokenizer_dir

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _hub_cache(root: Path, repo_id: str) -> Path:
    """What vLLM's download leaves in $HF_HOME/hub for ``repo_id``: refs/main -> the snapshot's files."""
    repo = root / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        (snapshot / name).write_text("{}")
    return snapshot


def test_a_hub_id_is_published_as_its_cache_snapshot(tmp_path: Path) -> None:
    snapshot = _hub_cache(tmp_path, "Qwen/Qwen2.5-0.5B-Instruct")

    def cached(repo_id: str, filename: str) -> str | None:
        found = try_to_load_from_cache(repo_id, filename, cache_dir=tmp_path)
        return found if isinstance(found, str) else None

    assert published_tokenizer_dir("Qwen/Qwen2.5-0.5B-Instruct", cached_file=cached) == str(snapshot)
    assert published_tokenizer_dir("Qwen/Not-Downloaded", cached_file=cached) is None


def test_a_directory_is_published_as_given_and_a_missing_path_never_looks_in_the_hub(tmp_path: Path) -> None:
    def no_lookup(repo_id: str, filename: str) -> str | None:
        raise AssertionError(f"looked up {repo_id} in the hub cache")

    assert published_tokenizer_dir(str(tmp_path), cached_file=no_lookup) == str(tmp_path)
    assert published_tokenizer_dir("/models/not-mounted", cached_file=no_lookup) is None
    assert published_tokenizer_dir("./relative-missing", cached_file=no_lookup) is None
