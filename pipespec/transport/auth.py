"""Stage links accept only their own pipeline (design 5c): a per-pipeline secret, sent as call metadata.

The launcher makes one secret per pipeline (`new_secret`) and hands it to every stage server, every
stage client and the coordinator. A client sends it with each call (`call_metadata`); a server
compares it in constant time (`authorized`). The coordinator's `Cancel` also takes it, so an
operator holding the secret may cancel any request.
"""

from __future__ import annotations

import hmac
import secrets
from typing import Any

METADATA_KEY = "pipespec-secret"


def new_secret() -> str:
    """A fresh per-pipeline secret (256 random bits, URL-safe text)."""
    return secrets.token_urlsafe(32)


def call_metadata(secret: str | None) -> tuple[tuple[str, str], ...]:
    """The metadata a client sends with each call (none without a secret)."""
    return ((METADATA_KEY, secret),) if secret is not None else ()


def authorized(context: Any, secret: str | None) -> bool:
    """Does the call behind `context` (a grpc.aio.ServicerContext) carry `secret`? True when there is none."""
    if secret is None:
        return True
    sent = dict(context.invocation_metadata() or ()).get(METADATA_KEY, "")
    return hmac.compare_digest(sent.encode(), secret.encode())
