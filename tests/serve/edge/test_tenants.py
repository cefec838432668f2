"""Tenants and the prefix cache (issue 36, point 1): a key file holds several keys, each a tenant;
a cached prefix is reused only within the tenant (and cache_salt) that wrote it. The issue's
reproduction: a victim's prompt holds a PIN, and an attacker who reads
usage.prompt_tokens_details.cached_tokens of `max_tokens: 1` guesses recovers it within one
tenant (where reuse is kept) and learns nothing across tenants; nor does the time of an answer
tell a right guess from a wrong one across tenants. /metrics' cached-token counter stays global."""

from __future__ import annotations

import re

import pytest
from fastapi.testclient import TestClient
from ready import ready
from tenant_story import KEY_FILE, KEYS, PIN, PUBLIC, SUFFIX, VICTIM

from doel.serve.core.prefix import MIN_REUSE, PARK_MIN, Prefixes
from doel.serve.edge.app import Settings, create_app
from doel.serve.edge.tenants import ONE, KeyFileError, Keys, parse_keys, partition

# --- the key file and the partition -------------------------------------------------------------


def test_a_key_file_holds_several_named_or_unnamed_keys():
    keys = parse_keys(KEY_FILE + "plain-key\n", "keys")
    assert {k: keys[k] for k in KEYS} == KEYS
    assert keys["plain-key"] not in ("victim", "attacker")  # an unnamed key: its own tenant
    assert keys["victim:victim-key"] == "victim"  # a whole line still works as its key
    with pytest.raises(KeyFileError, match="keys line 3 repeats the key of line 1"):
        parse_keys("a:k1\nb:k2\nc:k1\n", "keys")
    with pytest.raises(KeyFileError, match="keys is empty"):
        parse_keys("# nothing\n\n", "keys")


def test_keys_name_their_tenant_and_no_other():
    keys = Keys(parse_keys(KEY_FILE, "keys"))
    assert keys.tenant(b"victim-key") == keys.tenant(b"victim-phone") == "victim"
    assert keys.tenant(b"attacker-key") == "attacker"
    for wrong in (b"", b"victim", b"victim-key ", b"attacker-keyx", b"x" * 10_000):
        assert keys.tenant(wrong) is None


def test_the_partition_follows_the_mode():
    assert partition("per-tenant", "a", None) != partition("per-tenant", "b", None)
    assert partition("per-tenant", "a", "s") != partition("per-tenant", "a", None)
    assert partition("per-tenant", None, None) == ONE  # no key: one tenant, as before
    assert partition("shared", "a", None) == partition("shared", "b", None) == ONE
    assert partition("shared", "a", "s") != ONE  # the salt still partitions
    assert partition("off", "a", None) is None


def test_slots_are_reused_only_by_their_own_partition_and_parking_keeps_it():
    p = Prefixes(slots=4, context_length=512)
    prompt = list(range(100, 100 + 2 * MIN_REUSE))
    slot, reused = p.assign(prompt, [0, 1, 2, 3], owner=("a", ""))
    p.wrote(slot, 0, prompt)
    assert p.assign(prompt + [1], [0, 1, 2, 3], owner=("b", ""))[1] == 0
    assert p.assign(prompt + [1], [0, 1, 2, 3], owner=None)[1] == 0  # "off": nothing
    assert p.assign(prompt + [1], [0, 1, 2, 3], owner=("a", "")) == (slot, len(prompt))
    # Parked, the slot's entries keep their owner.
    long = list(range(1000, 1000 + PARK_MIN))
    p = Prefixes(slots=4, context_length=512)
    slot, _ = p.assign(long, [1], owner=("a", ""))
    p.wrote(slot, 0, long)
    dst = p.parking(1, 0, 3, busy={0, 2})
    p.moved(1, dst)
    assert p.assign(long + [1], [1, dst], owner=("b", ""))[1] == 0
    assert p.assign(long + [1], [1, dst], owner=("a", "")) == (dst, len(long))


# --- the attack, in process -------------------------------------------------------------------


def _client(tiny_bundle, **settings):
    app = create_app(Settings(bundle=str(tiny_bundle), threads=1, slots=4, **settings))
    client = TestClient(app)
    client.__enter__()
    ready(client)
    return client


def _ask(client, key: str, prompt: str, **extra) -> dict:
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, **extra}
    r = client.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text
    return r.json()


def _cached(answer: dict) -> int:
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


def recover(client, victim: str, attacker: str, victim_extra=None, attacker_extra=None) -> str:
    """The issue's attack: before each guess the victim sends its prompt again; the attacker
    sends the public start, the digits found so far and a guess, and keeps the guess whose
    cached_tokens is highest if only one is ('?' otherwise). 40 guesses for 4 digits."""
    known = ""
    for _ in PIN:
        seen = {}
        for digit in "0123456789":
            _ask(client, victim, VICTIM, **(victim_extra or {}))
            answer = _ask(
                client, attacker, PUBLIC + known + digit + SUFFIX, **(attacker_extra or {})
            )
            seen[digit] = _cached(answer)
        best = max(seen.values())
        winners = [d for d, n in seen.items() if n == best]
        known += winners[0] if len(winners) == 1 else "?"
    return known


@pytest.fixture(scope="module")
def tenants(tiny_bundle):
    client = _client(tiny_bundle, api_keys=KEYS)
    yield client
    client.__exit__(None, None, None)


def test_the_pin_is_recovered_within_one_tenant(tenants):
    # Reuse is kept where it is safe: the victim's own second key (its phone) reuses its
    # prefixes, and so the oracle works there, as it does for any one user of a cache.
    assert recover(tenants, "victim-key", "victim-phone") == PIN


def test_the_pin_is_not_recovered_across_tenants(tenants):
    metrics = _counter(tenants)
    # The victim's very text finds nothing for another tenant ...
    _ask(tenants, "victim-key", VICTIM)
    assert _cached(_ask(tenants, "attacker-key", VICTIM)) == 0
    assert recover(tenants, "victim-key", "attacker-key") == "????"
    # ... and every guess finds the same: only the attacker's own earlier guesses (their common
    # start), never the victim's, whatever the digit.
    seen = set()
    for digit in "0123456789":
        _ask(tenants, "victim-key", VICTIM)
        seen.add(_cached(_ask(tenants, "attacker-key", PUBLIC + digit + SUFFIX)))
    assert len(seen) == 1
    # The operator's counter still counts the victim's reuse of its own prefixes.
    assert _counter(tenants) > metrics


def test_a_cache_salt_partitions_within_a_tenant(tenants):
    salted = {"cache_salt": "session-1"}
    assert recover(tenants, "victim-key", "victim-phone", salted) == "????"
    assert recover(tenants, "victim-key", "victim-phone", salted, salted) == PIN


def test_chat_reuses_within_its_tenant_only(tenants):
    body = {"messages": [{"role": "system", "content": VICTIM}], "max_tokens": 1}
    auth = {k: {"Authorization": f"Bearer {k}"} for k in KEYS}
    for key in ("victim-key", "victim-phone"):
        r = tenants.post("/v1/chat/completions", json=body, headers=auth[key])
    assert _cached(r.json()) >= MIN_REUSE
    r = tenants.post("/v1/chat/completions", json=body, headers=auth["attacker-key"])
    assert r.status_code == 200 and _cached(r.json()) == 0


@pytest.mark.parametrize(("mode", "found"), [("shared", PIN), ("off", "????")])
def test_the_prefix_cache_mode_sets_what_is_shared(tiny_bundle, mode, found):
    client = _client(tiny_bundle, api_keys=KEYS, prefix_cache=mode)
    try:
        assert recover(client, "victim-key", "attacker-key") == found
    finally:
        client.__exit__(None, None, None)


def test_without_a_key_one_user_reuses_as_before(tiny_bundle):
    client = _client(tiny_bundle)
    try:
        _ask(client, "", VICTIM)
        again = _ask(client, "", VICTIM, cache_salt=None)
        assert _cached(again) == again["usage"]["prompt_tokens"] - 1
        assert recover(client, "", "") == PIN
    finally:
        client.__exit__(None, None, None)


def _counter(client) -> float:
    text = client.get("/metrics", headers={"Authorization": "Bearer victim-key"}).text
    return float(re.search(r"^doel_prompt_tokens_cached_total (\S+)$", text, re.M).group(1))
