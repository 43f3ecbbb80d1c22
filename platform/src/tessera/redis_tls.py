"""The TLS context a ``rediss://`` URL asks for, for the lean Redis connection (``redis_wire.py``).

redis-py reads TLS options from the URL's query (``ssl_ca_certs``, ``ssl_certfile``, ``ssl_keyfile``,
``ssl_cert_reqs``, ``ssl_check_hostname``, …) into its ``SSLConnection``; the lean connection speaks to the same
server with the same URL, so it must honour them the same way. Without them it would verify against the
system's CAs only: with a private CA every admission fails (503), or, failing open, nothing is limited.
The defaults are redis-py's: the certificate is required and the host name checked.
"""

from __future__ import annotations

import ssl
from collections.abc import Mapping
from typing import Any

_CERT_REQS = {"none": ssl.CERT_NONE, "optional": ssl.CERT_OPTIONAL, "required": ssl.CERT_REQUIRED}


def tls_context(options: Mapping[str, Any]) -> ssl.SSLContext:
    """``options``: redis-py's ``parse_url`` of a ``rediss://`` URL."""
    reqs = options.get("ssl_cert_reqs", "required")
    verify_mode = _CERT_REQS[reqs.lower()] if isinstance(reqs, str) else ssl.VerifyMode(reqs)
    context = ssl.create_default_context(cafile=options.get("ssl_ca_certs"), capath=options.get("ssl_ca_path"),
                                         cadata=options.get("ssl_ca_data"))
    if options.get("ssl_certfile"):
        context.load_cert_chain(options["ssl_certfile"], options.get("ssl_keyfile"), options.get("ssl_password"))
    # check_hostname before verify_mode: CERT_NONE is refused while the host name is checked.
    context.check_hostname = bool(options.get("ssl_check_hostname", True)) and verify_mode != ssl.CERT_NONE
    context.verify_mode = verify_mode
    if options.get("ssl_min_version") is not None:
        context.minimum_version = options["ssl_min_version"]
    if options.get("ssl_ciphers"):
        context.set_ciphers(options["ssl_ciphers"])
    return context
