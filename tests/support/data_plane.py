"""Test calls to engine replicas, signed with the session's data-plane key as the gateway signs its own.

``tests/conftest.py`` makes the key file and sets ``TESSERA_DATA_PLANE_KEY_FILE`` before any test runs, so
every replica, gateway and controller a test starts (in process, in a subprocess or in a Ray worker) has it.
A test calls a replica with ``auth=ENGINE_AUTH`` (httpx), ``headers=signed_headers(...)`` (anything else),
or, to play the attacker, without either.
"""

from __future__ import annotations

import functools
from collections.abc import Generator

import httpx

from tessera.data_plane_auth import SIGNATURE_HEADER, Signer, signer_from_settings
from tessera.settings import load_settings


@functools.cache
def session_signer() -> Signer:
    return signer_from_settings(load_settings(), "a test")


def signed_headers(method: str, target: str, body: bytes = b"") -> dict[str, str]:
    return session_signer().headers(method, target, body)


class EngineAuth(httpx.Auth):
    """httpx signs each request with the session's key: method, raw path (with its query), body."""

    requires_request_body = True

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        request.headers[SIGNATURE_HEADER] = session_signer().sign(request.method, request.url.raw_path.decode(),
                                                                  request.content)
        yield request


ENGINE_AUTH = EngineAuth()
