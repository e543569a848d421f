"""Per-key limits, on both backends: the in-process one and a real Redis (started through
scripts/redis.sh). Windows are made short through the constructors where a test waits one out."""

from __future__ import annotations

import asyncio
import functools
import math
import multiprocessing
import random
import re
import uuid
from pathlib import Path

import pytest

from tokenway.gateway.limits import (
    InProcessLimiter,
    Limiter,
    LimitSpec,
    format_reset,
    make_limiter,
)

REDIS_SH = Path(__file__).resolve().parents[2] / "scripts" / "redis.sh"
RESET = re.compile(r"^(\d+ms|(\d+h)?(\d+m)?\d+(\.\d{1,3})?s)$")


@pytest.fixture(params=["memory", "redis"])
def backend(request):
    """A limiter factory, called inside the test's event loop (Redis connections belong to one)."""
    if request.param == "memory":
        return InProcessLimiter
    from tokenway.gateway.limits_redis import RedisLimiter

    return functools.partial(RedisLimiter, request.getfixturevalue("redis_url"))


def run(backend, body, **windows):
    async def main():
        limiter = backend(**windows)
        try:
            return await body(limiter)
        finally:
            await limiter.close()

    return asyncio.run(main())


def new_key() -> str:
    return f"test-{uuid.uuid4().hex[:12]}"  # a Redis may outlive a run: never reuse a key


def seconds(reset: str) -> float:
    assert RESET.match(reset), reset
    if reset.endswith("ms"):
        return int(reset[:-2]) / 1000
    parts = re.match(r"^(?:(\d+)h)?(?:(\d+)m)?([\d.]+)s$", reset)
    return int(parts[1] or 0) * 3600 + int(parts[2] or 0) * 60 + float(parts[3])


def test_rpm_admits_exactly_n_then_the_next_after_the_oldest_has_left(backend):
    async def body(limiter: Limiter):
        key, spec = new_key(), LimitSpec(rpm=5)
        assert (await limiter.admit(key, spec, 0)).allowed
        await asyncio.sleep(0.5)  # the oldest is now 0.5 s older than the other four
        for _ in range(4):
            assert (await limiter.admit(key, spec, 0)).allowed
        refused = await limiter.admit(key, spec, 0)
        assert not refused.allowed and refused.reservation is None and refused.limit_kind == "requests"
        assert 0 < refused.retry_after_s <= 2.0 - 0.5  # when the oldest leaves, not the newest
        assert refused.headers["retry-after"] == str(max(1, math.ceil(refused.retry_after_s)))
        assert refused.headers["retry-after-ms"] == str(math.ceil(refused.retry_after_s * 1000))
        assert refused.headers["x-ratelimit-remaining-requests"] == "0"

        await asyncio.sleep(refused.retry_after_s)
        assert (await limiter.admit(key, spec, 0)).allowed
        again = await limiter.admit(key, spec, 0)  # only the oldest left: the window is full again
        assert not again.allowed and again.limit_kind == "requests"

    run(backend, body, window_s=2.0)


def test_concurrent_token_reservations_cannot_overshoot_and_reconcile_gives_back(backend):
    async def body(limiter: Limiter):
        key, spec = new_key(), LimitSpec(tpm=1000)
        decisions = await asyncio.gather(*(limiter.admit(key, spec, 300) for _ in range(20)))
        admitted = [d.reservation for d in decisions if d.allowed]
        assert len(admitted) == 3
        refused = [d for d in decisions if not d.allowed]
        assert {d.limit_kind for d in refused} == {"tokens"}
        assert all(0 < d.retry_after_s <= 60 for d in refused)
        assert (await limiter.headers(key, spec))["x-ratelimit-remaining-tokens"] == "100"

        for reservation in admitted:
            await limiter.reconcile(reservation, used_tokens=100)  # 200 of each come back
        await limiter.reconcile(admitted[0], used_tokens=0)  # a second reconcile changes nothing
        assert (await limiter.headers(key, spec))["x-ratelimit-remaining-tokens"] == "700"

        decisions = await asyncio.gather(*(limiter.admit(key, spec, 300) for _ in range(20)))
        assert sum(d.allowed for d in decisions) == 2  # 300 used + 2 x 300 reserved
        assert (await limiter.headers(key, spec))["x-ratelimit-remaining-tokens"] == "100"

    run(backend, body)


def test_tokens_refused_are_admitted_once_enough_of_the_oldest_have_left(backend):
    async def body(limiter: Limiter):
        key, spec = new_key(), LimitSpec(tpm=1000)
        assert (await limiter.admit(key, spec, 400)).allowed
        await asyncio.sleep(0.5)
        assert (await limiter.admit(key, spec, 600)).allowed
        refused = await limiter.admit(key, spec, 400)
        assert refused.limit_kind == "tokens" and 0 < refused.retry_after_s <= 2.0 - 0.5  # the 400 suffice
        await asyncio.sleep(refused.retry_after_s)
        assert (await limiter.admit(key, spec, 400)).allowed
        assert (await limiter.admit(key, spec, 1)).limit_kind == "tokens"

    run(backend, body, window_s=2.0)


def test_used_plus_reserved_tokens_never_exceed_tpm_under_random_load(backend):
    tpm = 2000
    rng = random.Random(4)

    async def body(limiter: Limiter):
        key, spec = new_key(), LimitSpec(tpm=tpm)
        rid_to_tokens: dict[str, int] = {}  # every admitted request: reserved, then used

        async def client():
            for _ in range(5):
                reserve = rng.randint(1, 600)
                decision = await limiter.admit(key, spec, reserve)
                if not decision.allowed:
                    continue
                rid_to_tokens[decision.reservation.reservation_id] = reserve
                assert sum(rid_to_tokens.values()) <= tpm
                await asyncio.sleep(rng.random() * 0.005)
                used = rng.randint(0, reserve)
                rid_to_tokens[decision.reservation.reservation_id] = used  # before: ours never exceeds the limiter's
                await limiter.reconcile(decision.reservation, used)

        await asyncio.gather(*(client() for _ in range(40)))
        assert len(rid_to_tokens) > 3  # reconciling let more in than the reservations alone would
        remaining = int((await limiter.headers(key, spec))["x-ratelimit-remaining-tokens"])
        assert remaining == tpm - sum(rid_to_tokens.values())

    run(backend, body)


def test_concurrency_slots_are_freed_by_reconcile_once(backend):
    async def body(limiter: Limiter):
        key, spec = new_key(), LimitSpec(max_concurrent=2)
        first, second = [await limiter.admit(key, spec, 10) for _ in range(2)]
        assert first.allowed and second.allowed
        refused = await limiter.admit(key, spec, 10)
        assert not refused.allowed and refused.limit_kind == "concurrency" and refused.retry_after_s == 1.0

        await limiter.reconcile(first.reservation, 5)
        third = await limiter.admit(key, spec, 10)
        assert third.allowed
        await limiter.reconcile(first.reservation, 5)  # idempotent: frees no second slot
        assert (await limiter.admit(key, spec, 10)).limit_kind == "concurrency"

    run(backend, body)


def test_a_reservation_never_reconciled_frees_its_slot_after_its_ttl(backend):
    async def body(limiter: Limiter):
        key, spec = new_key(), LimitSpec(max_concurrent=1)
        lost = await limiter.admit(key, spec, 10)  # as if its gateway died
        assert lost.allowed and not (await limiter.admit(key, spec, 10)).allowed
        await asyncio.sleep(0.5)
        assert (await limiter.admit(key, spec, 10)).allowed
        await limiter.reconcile(lost.reservation, 0)  # too late: it frees nothing
        assert (await limiter.admit(key, spec, 10)).limit_kind == "concurrency"

    run(backend, body, reservation_ttl_s=0.5)


def test_tokens_per_day(backend):
    async def body(limiter: Limiter):
        key, spec = new_key(), LimitSpec(tpd=1000)
        first = await limiter.admit(key, spec, 600)
        assert first.allowed
        refused = await limiter.admit(key, spec, 600)
        assert not refused.allowed and refused.limit_kind == "tokens_per_day" and 0 < refused.retry_after_s <= 2.0
        await limiter.reconcile(first.reservation, 300)
        await asyncio.sleep(0.5)  # the next request goes in a later bucket
        assert (await limiter.admit(key, spec, 600)).allowed  # 300 used + 600 reserved
        refused = await limiter.admit(key, spec, 200)
        assert refused.limit_kind == "tokens_per_day" and 0 < refused.retry_after_s <= 2.0 - 0.5
        await asyncio.sleep(refused.retry_after_s)  # the first request's bucket leaves the day
        assert (await limiter.admit(key, spec, 200)).allowed
        assert (await limiter.admit(key, spec, 201)).limit_kind == "tokens_per_day"  # 600 + 200 + 201

    run(backend, body, day_s=2.0)


def test_headers_report_the_window(backend):
    async def body(limiter: Limiter):
        key, spec = new_key(), LimitSpec(rpm=10, tpm=1000)
        assert await limiter.headers(key, spec) == {
            "x-ratelimit-limit-requests": "10",
            "x-ratelimit-remaining-requests": "10",
            "x-ratelimit-reset-requests": "0s",
            "x-ratelimit-limit-tokens": "1000",
            "x-ratelimit-remaining-tokens": "1000",
            "x-ratelimit-reset-tokens": "0s",
        }
        decision = await limiter.admit(key, spec, 300)
        headers = decision.headers
        assert "retry-after" not in headers
        assert headers["x-ratelimit-remaining-requests"] == "9" and headers["x-ratelimit-remaining-tokens"] == "700"
        assert 0 < seconds(headers["x-ratelimit-reset-requests"]) <= 60
        assert 0 < seconds(headers["x-ratelimit-reset-tokens"]) <= 60
        await limiter.reconcile(decision.reservation, 100)
        headers = await limiter.headers(key, spec)
        assert headers["x-ratelimit-remaining-requests"] == "9" and headers["x-ratelimit-remaining-tokens"] == "900"
        assert await limiter.headers(key, LimitSpec(tpd=5)) == {}  # no per-minute limit to report

    run(backend, body)


def test_retry_after_is_capped_at_120_seconds(backend):
    async def body(limiter: Limiter):
        key, spec = new_key(), LimitSpec(rpm=1)
        assert (await limiter.admit(key, spec, 0)).allowed
        refused = await limiter.admit(key, spec, 0)
        assert refused.retry_after_s == 120.0
        assert refused.headers["retry-after"] == "120" and refused.headers["retry-after-ms"] == "120000"

    run(backend, body, window_s=3600.0)


def test_a_request_larger_than_the_limit_is_refused_without_a_retry(backend):
    async def body(limiter: Limiter):
        key = new_key()
        refused = await limiter.admit(key, LimitSpec(tpm=100), 101)
        assert (refused.allowed, refused.limit_kind, refused.retry_after_s) == (False, "tokens", None)
        assert "retry-after" not in refused.headers and "retry-after-ms" not in refused.headers
        refused = await limiter.admit(key, LimitSpec(tpm=1000, tpd=50), 51)
        assert (refused.limit_kind, refused.retry_after_s) == ("tokens_per_day", None)
        assert (await limiter.admit(key, LimitSpec(tpm=100), 100)).allowed  # the refusals reserved nothing

    run(backend, body)


def test_format_reset_is_openais():
    us_to_reset = {0: "0s", 1: "1ms", 20_000: "20ms", 999_000: "999ms", 1_000_000: "1s", 1_500_000: "1.5s",
                   17_497_000: "17.497s", 60_000_000: "1m0s", 360_000_000: "6m0s", 81_600_000: "1m21.6s",
                   3_600_000_000: "1h0m0s", 3_723_500_000: "1h2m3.5s"}  # fmt: skip
    assert {us: format_reset(us) for us in us_to_reset} == us_to_reset


def test_limit_spec_and_make_limiter_check_their_input(redis_url):
    with pytest.raises(ValueError):
        LimitSpec(rpm=0)
    with pytest.raises(ValueError):
        LimitSpec(tpm=1.5)
    assert isinstance(make_limiter(None), InProcessLimiter) and isinstance(make_limiter("memory"), InProcessLimiter)
    from tokenway.gateway.leases import LeasedLimiter
    from tokenway.gateway.limits_redis import RedisLimiter

    limiter = make_limiter(redis_url)  # calls admitted from leases on the Redis
    assert isinstance(limiter, LeasedLimiter) and isinstance(limiter.remote, RedisLimiter)
    with pytest.raises(ValueError):
        make_limiter("memcached://localhost")


def test_redis_keys_expire_together(redis_url):
    from redis.asyncio import Redis

    from tokenway.gateway.limits_redis import RedisLimiter

    async def main():
        limiter, client = RedisLimiter(redis_url, window_s=5.0, reservation_ttl_s=7.0), Redis.from_url(redis_url)
        key = new_key()
        decision = await limiter.admit(key, LimitSpec(rpm=10), 10)
        await limiter.reconcile(decision.reservation, 3)
        names = await client.keys(f"tokenway:limits:{{{key}}}:*")
        ttls_ms = [await client.pttl(name) for name in names]
        await limiter.close()
        await client.aclose()
        return len(names), ttls_ms

    num_keys, ttls_ms = asyncio.run(main())
    assert num_keys == 5  # all but the in-flight set and hash, which reconcile emptied
    assert all(0 < ttl <= 8_000 for ttl in ttls_ms)  # the longest horizon (the TTL) and a second


def _admit_from_another_process(redis_url: str, key: str, barrier, results) -> None:
    from tokenway.gateway.limits_redis import RedisLimiter

    async def main() -> int:
        limiter = RedisLimiter(redis_url)
        await limiter.headers(key, LimitSpec(rpm=50))  # connect and load the script before the start
        barrier.wait()
        decisions = await asyncio.gather(*(limiter.admit(key, LimitSpec(rpm=50), 1) for _ in range(100)))
        await limiter.close()
        return sum(d.allowed for d in decisions)

    results.put(asyncio.run(main()))


def test_two_processes_sharing_redis_admit_exactly_the_rpm(redis_url):
    context = multiprocessing.get_context("fork")
    key, barrier, results = new_key(), context.Barrier(2), context.Queue()
    processes = [
        context.Process(target=_admit_from_another_process, args=(redis_url, key, barrier, results)) for _ in range(2)
    ]
    for process in processes:
        process.start()
    num_admitted = [results.get(timeout=60) for _ in processes]
    for process in processes:
        process.join(timeout=60)
        assert process.exitcode == 0
    assert sum(num_admitted) == 50

    async def remaining() -> str:
        from tokenway.gateway.limits_redis import RedisLimiter

        limiter = RedisLimiter(redis_url)
        headers = await limiter.headers(key, LimitSpec(rpm=50))
        await limiter.close()
        return headers["x-ratelimit-remaining-requests"]

    assert asyncio.run(remaining()) == "0"
