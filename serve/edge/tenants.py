"""Tenants: who a request's API key says it is, and which part of the prefix cache it may use.

`--api-key-file` holds one key a line, each optionally named (`alice:KEY`); blank lines and
`#` comments are skipped. Each name is a tenant (two keys under one name are one tenant: a key
being rotated); an unnamed key is a tenant of its own. A named line's whole text is accepted as
its key too, so a file written before names existed (one key that happens to hold a colon)
keeps working. Keys are compared in constant time, against every key, whichever matches.

The prefix cache (`Prefixes`) reuses a slot's entries only for a request of the same
partition: `partition(mode, tenant, salt)`. A cached prefix is an oracle on the text that wrote
it (the usage's cached_tokens, and the time to the first token, tell a right guess of the next
character from a wrong one), so by default ("per-tenant") a tenant's prompts are reused only
for that tenant, and a request's `cache_salt` (as vLLM takes it) partitions further within it.
"shared" lets all tenants share (the salt still partitions); "off" reuses nothing. Without a key
there is one tenant, so a single user's server reuses as it always did.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Hashable

MODES = ("per-tenant", "shared", "off")
DEFAULT_MODE = "per-tenant"
ONE = ("", "")  # the partition of a server without keys, and of a request without a salt
NAME = re.compile(r"[A-Za-z0-9_.@-]{1,64}")  # a tenant's name before the colon


class KeyFileError(ValueError):
    """A key file that cannot be used; the message names the line."""


def parse_keys(text: str, where: str) -> dict[str, str]:
    """{key: tenant} of a key file's text; KeyFileError for an empty file or a repeated key."""
    keys: dict[str, str] = {}
    first: dict[str, int] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()  # a header value cannot carry edge spaces anyway
        if not line or line.startswith("#"):
            continue
        name, colon, key = (part.strip() for part in line.partition(":"))
        if colon and key and NAME.fullmatch(name):
            given = {key: name, line: name}  # `name:key`, or the whole line as an old key
        else:
            given = {line: f"#{n}"}  # '#' is no name's character: it cannot merge with one
        for k, tenant in given.items():
            if k in first and keys[k] != tenant:
                raise KeyFileError(
                    f"{where} line {n} repeats the key of line {first[k]}; give each key once"
                )
            first.setdefault(k, n)
            keys[k] = tenant
    if not keys:
        raise KeyFileError(f"{where} is empty; give a key, or unset it to serve without one")
    return keys


class Keys:
    """The keys a Guard accepts, each with its tenant."""

    def __init__(self, keys: dict[str, str]):
        # Compared as digests: every comparison is of 32 bytes, whatever the key's length.
        self.digests = [(_digest(k.encode()), t) for k, t in keys.items()]

    def tenant(self, token: bytes) -> str | None:
        """The tenant whose key `token` is, or None. Every key is compared, in constant time,
        so the time taken says nothing of which key (or how much of one) matched."""
        given, found = _digest(token), None
        for digest, tenant in self.digests:
            if hmac.compare_digest(given, digest):
                found = tenant
        return found


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


def partition(mode: str, tenant: str | None, salt: str | None) -> Hashable | None:
    """The prefix cache's partition of a request: None reuses nothing (mode "off")."""
    if mode == "off":
        return None
    owner = (tenant or "") if mode == "per-tenant" else ""
    return (owner, salt or "")
