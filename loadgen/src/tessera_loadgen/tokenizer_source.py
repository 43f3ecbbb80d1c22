"""Where a run's tokenizers come from: ``--tokenizer auto|none|DIR``.

- ``DIR``: a local Hugging Face model directory, used for every model of the run.
- ``auto`` (default): each model's tokenizer from the Tessera gateway, ``GET /v1/models/{model}/tokenizer``
  with a key of a tenant that uses the model. A server without that endpoint (vLLM's own server, the mock
  server) or an error leaves the model's lengths approximate, with a warning that says why.
- ``none``: approximate lengths (words) for every model.

Only models that some tenant sends synthetic prompts to need a tokenizer (ShareGPT text is sent as is).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final
from urllib.parse import quote

from tessera_loadgen.tokenizer_spec import TokenizerDocument, TokenizerSpec, load_model_dir
from tessera_loadgen.workload import Tenant, Workload

if TYPE_CHECKING:
    from tessera_loadgen.client import Target

TOKENIZER_AUTO: Final = "auto"
TOKENIZER_NONE: Final = "none"
FETCH_TIMEOUT_S = 60.0
"""A real model's tokenizer.json is several megabytes; the gateway sends it in one response."""

APPROXIMATE_HINT = "pass --tokenizer DIR (the model's Hugging Face directory) for lengths in its tokens"


@dataclass(slots=True)
class TokenizerResolution:
    """Each model's tokenizer where one was found, and a warning for each model left approximate."""

    specs: dict[str, TokenizerSpec] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


def tokenizer_url(target: Target, model: str) -> str:
    return f"{target.url}/v1/models/{quote(model, safe='')}/tokenizer"


def models_with_synthetic_prompts(workload: Workload, models: Mapping[str, str]) -> list[str]:
    """The models (of ``models``: tenant -> model) that receive synthetic prompts, in tenant order."""
    needed: dict[str, None] = {}
    for tenant in workload.tenants:
        if any(c.prompt.source == "synthetic" for c in tenant.classes):
            needed[models[tenant.name]] = None
    return list(needed)


def optional_api_key(tenant: Tenant) -> str | None:
    """The tenant's key, or ``None`` when its environment variable is unset (a look-up only, not a run)."""
    try:
        return tenant.resolved_api_key()
    except ValueError:
        return None


def _error_text(response: Any) -> str:
    """The message of an OpenAI-style error body, else the start of the body."""
    try:
        data = response.json()
    except ValueError:
        return str(response.text[:200])
    error = data.get("error") if isinstance(data, dict) else None
    if isinstance(error, dict) and error.get("message"):
        return str(error["message"])
    return str(data)[:200]


async def fetch_tokenizer(target: Target, model: str, api_key: str | None) -> TokenizerSpec | str:
    """The model's tokenizer from the gateway, or a sentence saying why there is none."""
    import httpx
    from pydantic import ValidationError

    url = tokenizer_url(target, model)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with httpx.AsyncClient(timeout=FETCH_TIMEOUT_S) as http:
            response = await http.get(url, headers=headers)
    except httpx.HTTPError as exc:
        return f"GET {url} failed ({type(exc).__name__}: {exc})"
    if response.status_code != 200:
        return f"GET {url} answered {response.status_code} ({_error_text(response)})"
    try:
        document = TokenizerDocument.model_validate_json(response.content)
    except ValidationError as exc:
        return f"GET {url} did not return a tokenizer document ({exc.error_count()} errors)"
    return document.to_spec(source=url)


async def resolve_tokenizers(
    choice: str, target: Target | None, workload: Workload, models: Mapping[str, str]
) -> TokenizerResolution:
    """The tokenizers for ``--tokenizer choice``; ``models`` maps each tenant to its model."""
    needed = models_with_synthetic_prompts(workload, models)
    resolution = TokenizerResolution()
    if not needed:
        return resolution
    if choice == TOKENIZER_NONE:
        resolution.warnings.append("prompt lengths are approximate (words, not the model's tokens): --tokenizer none")
        return resolution
    if choice != TOKENIZER_AUTO:
        spec = load_model_dir(choice)
        resolution.specs = dict.fromkeys(needed, spec)
        return resolution
    if target is None:
        resolution.warnings.append(f"prompt lengths are approximate (no server to ask); {APPROXIMATE_HINT}")
        return resolution
    for model in needed:
        tenant = next(t for t in workload.tenants if models[t.name] == model)
        found = await fetch_tokenizer(target, model, optional_api_key(tenant))
        if isinstance(found, str):
            resolution.warnings.append(
                f"prompt lengths for {model} are approximate (words, not the model's tokens): {found}; "
                f"{APPROXIMATE_HINT}"
            )
        else:
            resolution.specs[model] = found
    return resolution
