"""A key's batch share (gateway/shares.py) in the limits, on both backends (in process, and a
real Redis through scripts/redis.sh): a call with a share counts against the key's limits and
the share's, held by both or by neither, exactly under concurrency."""

from __future__ import annotations

import asyncio
import random

import pytest

from tokenway.gateway.limits import Limiter, LimitSpec

from .test_limits import backend, new_key, run  # noqa: F401 - backend is a fixture

KEY = LimitSpec(rpm=10, tpm=2000, max_concurrent=8)
SHARE = LimitSpec(rpm=5, tpm=1000, max_concurrent=4)


def test_a_share_admits_its_part_and_leaves_the_rest_to_the_key(backend):  # noqa: F811
    async def body(limiter: Limiter):
        key, spec, share = new_key(), LimitSpec(rpm=10), LimitSpec(rpm=5)
        batch = [await limiter.admit(key, spec, 10, share) for _ in range(5)]
        assert all(d.allowed and d.reservation.in_share for d in batch)
        refused = await limiter.admit(key, spec, 10, share)
        assert (refused.allowed, refused.limit_kind, refused.by_share) == (False, "requests", True)
        assert 0 < refused.retry_after_s <= 60 and "retry-after" in refused.headers
        assert refused.headers["x-ratelimit-remaining-requests"] == "5"  # the key's own window
        interactive = [await limiter.admit(key, spec, 10) for _ in range(5)]
        assert all(d.allowed and not d.reservation.in_share for d in interactive)
        refused = await limiter.admit(key, spec, 10)
        assert (refused.limit_kind, refused.by_share) == ("requests", False)

    run(backend, body)


def test_a_share_is_reconciled_in_both_and_once(backend):  # noqa: F811
    async def body(limiter: Limiter):
        key = new_key()
        first = await limiter.admit(key, KEY, 600, SHARE)
        assert first.allowed
        refused = await limiter.admit(key, KEY, 600, SHARE)  # 1200 > the share's 1000
        assert (refused.limit_kind, refused.by_share) == ("tokens", True)
        await limiter.reconcile(first.reservation, 100)
        await limiter.reconcile(first.reservation, 0)  # a second reconcile changes nothing
        second = await limiter.admit(key, KEY, 900, SHARE)  # 100 + 900 fit the share now
        assert second.allowed and second.headers["x-ratelimit-remaining-tokens"] == "1000"
        assert (await limiter.admit(key, KEY, 1, SHARE)).by_share
        assert (await limiter.admit(key, KEY, 1000)).allowed  # the key's other calls: the rest, exactly
        assert not (await limiter.admit(key, KEY, 1)).allowed

    run(backend, body)


def test_a_call_larger_than_the_share_is_refused_without_a_retry(backend):  # noqa: F811
    async def body(limiter: Limiter):
        key = new_key()
        refused = await limiter.admit(key, KEY, 1001, SHARE)
        assert (refused.allowed, refused.limit_kind, refused.by_share, refused.retry_after_s) == (
            False, "tokens", True, None)
        assert (await limiter.admit(key, KEY, 1000, SHARE)).allowed  # the refusal held nothing

    run(backend, body)


def test_a_share_slots_are_its_own_and_the_keys(backend):  # noqa: F811
    async def body(limiter: Limiter):
        key = new_key()
        held = [await limiter.admit(key, KEY, 1, SHARE) for _ in range(4)]
        refused = await limiter.admit(key, KEY, 1, SHARE)
        assert (refused.limit_kind, refused.by_share, refused.retry_after_s) == ("concurrency", True, 1.0)
        others = [await limiter.admit(key, KEY, 1) for _ in range(4)]
        assert all(d.allowed for d in held + others)
        assert (await limiter.admit(key, KEY, 1)).limit_kind == "concurrency"
        await limiter.reconcile(held[0].reservation, 1)  # frees a slot in the share and in the key
        assert (await limiter.admit(key, KEY, 1, SHARE)).allowed

    run(backend, body)


@pytest.mark.parametrize("seed", [1, 2])
def test_shared_and_unshared_calls_at_once_never_pass_either_limit(backend, seed):  # noqa: F811
    rng = random.Random(seed)

    async def body(limiter: Limiter):
        key = new_key()
        spec, share = LimitSpec(tpm=3000), LimitSpec(tpm=1200)
        rid_to_tokens: dict[str, tuple[bool, int]] = {}  # every admitted call: in the share?, its tokens

        async def client(in_share: bool):
            for _ in range(6):
                reserve = rng.randint(1, 500)
                decision = await limiter.admit(key, spec, reserve, share if in_share else None)
                if not decision.allowed:
                    continue
                rid = decision.reservation.reservation_id
                rid_to_tokens[rid] = (in_share, reserve)
                assert sum(n for _, n in rid_to_tokens.values()) <= spec.tpm
                assert sum(n for s, n in rid_to_tokens.values() if s) <= share.tpm
                await asyncio.sleep(rng.random() * 0.005)
                used = rng.randint(0, reserve)
                rid_to_tokens[rid] = (in_share, used)
                await limiter.reconcile(decision.reservation, used)

        await asyncio.gather(*(client(i % 2 == 0) for i in range(40)))
        in_share = sum(n for s, n in rid_to_tokens.values() if s)
        total = sum(n for _, n in rid_to_tokens.values())
        assert 0 < in_share < total
        assert int((await limiter.headers(key, spec))["x-ratelimit-remaining-tokens"]) == spec.tpm - total
        share_left, key_left = share.tpm - in_share, spec.tpm - total
        fill = min(share_left, key_left)  # exactly what the share may still take
        if fill > 0:
            assert (await limiter.admit(key, spec, fill, share)).allowed
        refused = await limiter.admit(key, spec, 1, share)
        assert not refused.allowed and (share_left == key_left or refused.by_share == (share_left < key_left))

    run(backend, body)
