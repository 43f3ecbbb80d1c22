"""Fuzzing the gateway where tests/e2e/test_tenancy_schema.py does not reach: the admin API (paths, methods,
bodies and tokens the OpenAPI document does not list) and hostile request heads (oversized, duplicated,
non-ASCII, CRLF and NUL in values, thousands of headers, conflicting framing) sent over a raw socket, as
httpx would refuse to. Against a real gateway process, Redis and the engine: no input may get a 5xx, and
every one is answered (a server that neither answers nor closes fails the test as a hang).

Each test prints what it tried (``-s``): inputs, and the answers by status."""

from __future__ import annotations

import json
import urllib.parse
from collections import Counter
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.support.gateways import GatewayProcess
from tests.support.hostile_http import exchange, head
from tests.support.tenancy import ADMIN_TOKEN, MODEL, TenantHandle, create_tenant

pytestmark = pytest.mark.adversarial

# The gateway's default TESSERA_MAX_HEADER_BYTES and TESSERA_MAX_URL_BYTES (the shared gateways keep them).
HEADER_LIMIT_BYTES = 32_768
URL_LIMIT_BYTES = 8192
FUZZ = settings(max_examples=150, deadline=None, database=None, derandomize=True,
                suppress_health_check=list(HealthCheck))

NASTY_TEXT = ["foo:keys", "..", "%2e%2e", "a/b", "\x00", "*", "ключ", " ", "a" * 300, "t\r\nx: 1", "-", "_",
              "tenants", "keys", "%", "?", "#", "\ufeff", "<script>", "n" * 9000]


@pytest.fixture(scope="module")
def fuzz_tenant(gateways: list[GatewayProcess]) -> TenantHandle:
    return create_tenant(gateways[0], {"maxTokensCap": 2}, prefix="fuzz")


def json_values() -> st.SearchStrategy[Any]:
    scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False),
                        st.text(max_size=30))
    return st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                         st.dictionaries(st.text(max_size=12), inner, max_size=4)),
                        max_leaves=12)


POLICY_FIELDS = ["requestsPerMinute", "tokensPerMinute", "maxConcurrency", "budgetTokens", "budgetPeriod",
                 "priorityClass", "kvQuota", "allowedModels", "maxTokensCap", "maxPromptTokens", "maxN",
                 "prefixCacheIsolation", "bogus"]


def admin_bodies(tenant_names: st.SearchStrategy[str]) -> st.SearchStrategy[bytes | None]:
    policy = st.dictionaries(st.sampled_from(POLICY_FIELDS), json_values(), max_size=5)
    document = st.one_of(st.fixed_dictionaries({"name": tenant_names, "policy": policy}),
                         st.fixed_dictionaries({"policy": policy}), policy,
                         st.dictionaries(st.text(max_size=10), json_values(), max_size=4), json_values())
    return st.one_of(st.none(), document.map(lambda doc: json.dumps(doc).encode()), st.binary(max_size=64))


def test_the_admin_api_answers_every_input_without_a_server_error(gateways: list[GatewayProcess],
                                                                  fuzz_tenant: TenantHandle) -> None:
    names = st.one_of(st.sampled_from([fuzz_tenant.name, *NASTY_TEXT]), st.text(max_size=24))
    key_ids = st.one_of(st.sampled_from([fuzz_tenant.key_id, "0123456789ab", *NASTY_TEXT]), st.text(max_size=16))
    shapes = st.sampled_from(["tenants", "tenants/{name}", "tenants/{name}/keys", "tenants/{name}/usage",
                              "keys/{kid}", "tenants/{name}/keys/{kid}", "{name}", "tenants/{name}/{name}", ""])
    tried: Counter[str] = Counter()

    @FUZZ
    @given(method=st.sampled_from(["GET", "POST", "PATCH", "DELETE", "PUT", "HEAD", "OPTIONS"]), shape=shapes,
           name=names, kid=key_ids, quoted=st.booleans(), query=st.sampled_from(["", "period=day", "period=x%00"]),
           token=st.sampled_from([ADMIN_TOKEN, ADMIN_TOKEN, "wrong", ""]), body=admin_bodies(names))
    # Always one target over the URL limit: the draws reach one in most runs, not all (the tenant's name,
    # random per run, is among the strategies' choices).
    @example(method="GET", shape="tenants/{name}", name="n" * 9000, kid="x", quoted=False, query="",
             token=ADMIN_TOKEN, body=None)
    def run(method: str, shape: str, name: str, kid: str, quoted: bool, query: str, token: str,
            body: bytes | None) -> None:
        def part(text: str) -> str:
            return urllib.parse.quote(text, safe="" if quoted else ":*-_.~%")

        path = "/admin/" + shape.format(name=part(name), kid=part(kid))
        target = path + (f"?{query}" if query else "")
        headers = [(b"authorization", f"Bearer {token}".encode())] if token else []
        if body is not None:
            headers += [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        answer = exchange(gateways[0].port, [head(method, target, headers) + (body or b"")],
                          head_request=method == "HEAD")
        tried[f"{answer.status}"] += 1
        assert answer.status is not None and answer.status < 500, (method, target, body, answer)
        if answer.status >= 400 and method != "HEAD":
            assert answer.error_code, (method, target, answer)
        # A target over the URL limit is refused before anything reads it (the path names included).
        assert (answer.status == 414) == (len(target.encode()) > URL_LIMIT_BYTES), (len(target), answer)

    run()
    print(f"\nadmin fuzz: {sum(tried.values())} requests, answers by status {dict(sorted(tried.items()))}")
    assert tried["414"] > 0, "no target crossed the URL limit"
    # The tenant it could address is intact: fuzzing through the admin API made no 500 and no stray state.
    assert httpx.get(f"{gateways[0].url}/admin/tenants/{fuzz_tenant.name}",
                     headers={"authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=10).status_code in (200, 404)


HEADER_NAMES = [b"authorization", b"content-length", b"transfer-encoding", b"x-request-id", b"traceparent",
                b"tracestate", b"baggage", b"content-type", b"host", b"expect", b"connection", b"x-tessera-tenant",
                b"upgrade", b"cookie"]
HOSTILE_VALUES = [b"a" * 40_000, b"x\r\nx-injected: 1", b"x\ninjected", b"x\rinjected", b"\xff\xfe\x00",
                  "ключ".encode(), b"\x00", b"99999999999999999999999", b"-1", b"chunked", b"chunked, gzip",
                  b"100-continue", b"Bearer ", b"Bearer " + b"k" * 5000, b"00-" + b"f" * 32 + b"-" + b"f" * 16 + b"-01",
                  b"keep-alive, upgrade", b"websocket", b" ", b""]


def hostile_headers() -> st.SearchStrategy[list[tuple[bytes, bytes]]]:
    names = st.one_of(st.sampled_from(HEADER_NAMES), st.from_regex(rb"\A[a-z][a-z0-9-]{0,15}\Z"),
                      st.binary(min_size=1, max_size=16))
    values = st.one_of(st.sampled_from(HOSTILE_VALUES), st.binary(max_size=48),
                       st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=48).map(str.encode))
    few = st.lists(st.tuples(names, values), max_size=10)
    # One header repeated up to thousands of times (duplicates and huge counts).
    many = st.tuples(st.tuples(names, values), st.integers(2, 3000)).map(lambda pair: [pair[0]] * pair[1])
    return st.one_of(few, few, many)


def test_hostile_headers_get_no_server_error_and_no_hang(gateways: list[GatewayProcess],
                                                         fuzz_tenant: TenantHandle) -> None:
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1}).encode()
    missing_model = json.dumps({"model": "no-such-model", "prompt": "hi", "max_tokens": 1}).encode()
    tried: Counter[str] = Counter()

    @FUZZ
    @given(headers=hostile_headers(), keyed=st.booleans(),
           request=st.sampled_from(["models", "usage", "health", "completion", "completion", "admin", "engine"]))
    def run(headers: list[tuple[bytes, bytes]], keyed: bool, request: str) -> None:
        sent = [(b"authorization", f"Bearer {fuzz_tenant.key}".encode())] if keyed else []
        sent += headers
        if request in ("completion", "engine"):
            payload = body if request == "engine" else missing_model
            sent += [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
            raw = head("POST", "/v1/completions", sent) + payload
        else:
            target = {"models": "/v1/models", "usage": "/v1/usage", "health": "/health",
                      "admin": "/admin/tenants"}[request]
            raw = head("GET", target, sent)
        answer = exchange(gateways[1].port, [raw])
        tried[f"{answer.status}"] += 1
        assert answer.status is not None and answer.status < 500, (request, headers[:3], len(headers), answer)
        # The header limit, as the gateway counts it (name, value, ": ", CRLF), whatever else is wrong: over
        # it a 431 (or the parser's 400 for a malformed line met first), never served; within it no 431. The
        # parser trims a value's surrounding blanks: up to 2 bytes a header fewer than counted here.
        num_header_bytes = sum(len(name) + len(value) + 4 for name, value in [(b"host", b"gateway"), *sent])
        if num_header_bytes > HEADER_LIMIT_BYTES + 2 * (len(sent) + 1):
            assert answer.status in (400, 431), (num_header_bytes, answer)
        elif num_header_bytes <= HEADER_LIMIT_BYTES:
            assert answer.status != 431, (num_header_bytes, answer)
        sizes["over the header limit" if num_header_bytes > HEADER_LIMIT_BYTES else "within it"] += 1

    sizes: Counter[str] = Counter()
    run()
    print(f"\nheader fuzz: {sum(tried.values())} requests ({dict(sizes)}), answers by status "
          f"{dict(sorted(tried.items()))}")
    assert tried["431"] > 0, "no input crossed the header limit"
