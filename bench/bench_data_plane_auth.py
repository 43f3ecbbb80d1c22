"""What the data-plane signature costs per call (docs/security.md "The data plane"): the gateway's signing of a
``/generate`` body and the replica's check, for prompts of several lengths, in microseconds.
Run: ``.venv/bin/python bench/bench_data_plane_auth.py`` (a few seconds; prints a table, writes nothing)."""

from __future__ import annotations

import timeit

import orjson

from tessera.data_plane_auth import SIGNATURE_HEADER, ReplicaGuard, Signer

KEY = b"k" * 64
PROMPT_TOKENS = (0, 200, 2_000, 32_000)


def main() -> None:
    signer, guard = Signer(KEY), ReplicaGuard(KEY)
    print(f"{'prompt tokens':>13} {'body bytes':>10} {'sign µs':>8} {'verify µs':>9}")
    for num_tokens in PROMPT_TOKENS:
        body = orjson.dumps({"request_id": "tenant/chatcmpl-0123456789abcdef", "max_tokens": 64, "priority": 0,
                             "prompt_token_ids": list(range(1000, 1000 + num_tokens))})
        number = 20_000 if num_tokens < 5_000 else 1_000

        def sign(b: bytes = body) -> None:
            signer.sign("POST", "/generate", b)

        sign_s = min(timeit.repeat(sign, number=number, repeat=5))
        # Signed as a GET so that the same signature verifies every round (the replay cache, a dict lookup,
        # remembers POSTs only); the work is the same: the header, the body's SHA-256 and the MAC.
        headers = {SIGNATURE_HEADER: signer.sign("GET", "/generate", body)}

        def verify(b: bytes = body, h: dict[str, str] = headers) -> None:
            head = guard.check_head(h)
            assert not isinstance(head, str) and guard.check_body(head, "GET", "/generate", b) is None

        verify_s = min(timeit.repeat(verify, number=number, repeat=5))
        print(f"{num_tokens:>13} {len(body):>10} {sign_s / number * 1e6:>8.1f} {verify_s / number * 1e6:>9.1f}")


if __name__ == "__main__":
    main()
