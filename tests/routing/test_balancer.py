"""The balancer: least outstanding tokens, leases, exclusion, health, prefix affinity within
the load bound, the bounded queue; and a simulated shared-prefix workload against round robin."""

from __future__ import annotations

import asyncio
import heapq
import random
from collections import OrderedDict

import pytest

from tokenway.routing.balancer import Balancer, BalancerConfig, NoReplicaAvailable, PoolFull
from tokenway.routing.health import BreakerConfig, CircuitBreaker, ReplicaHealth, Unavailable
from tokenway.routing.prefix_index import PrefixIndex, prefix_block_hashes

NAMES = ("a", "b", "c")
BLOCK = 16


def make_balancer(config: BalancerConfig | None = None, *, healths=None, **kwargs) -> Balancer:
    name_to_health = {h.name: h for h in healths} if healths else None
    return Balancer(NAMES, config or BalancerConfig(block_size=BLOCK), name_to_health=name_to_health, **kwargs)


def loads(balancer: Balancer) -> dict[str, int]:
    return {v.name: v.num_outstanding_tokens for v in balancer.views()}


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 50000) for _ in range(n)]


def make_healths(clock, cooldown: float = 5.0) -> list[ReplicaHealth]:
    config = BreakerConfig(failure_threshold=2, failure_window=10.0, cooldown=cooldown)
    return [ReplicaHealth(name, CircuitBreaker(config, clock=clock)) for name in NAMES]


# --- prefix index -------------------------------------------------------------------------


def test_block_hashes_cover_full_blocks_and_chain_their_parents():
    prompt = tokens(0, 3 * BLOCK + 5)
    block_hashes = prefix_block_hashes(prompt, BLOCK)
    assert len(block_hashes) == 3
    assert prefix_block_hashes(prompt[: 2 * BLOCK], BLOCK) == block_hashes[:2]
    # The same block after a different first block hashes differently: a hash is a whole prefix.
    other = tokens(1, BLOCK) + prompt[BLOCK:]
    assert prefix_block_hashes(other, BLOCK)[1] != block_hashes[1]
    assert prefix_block_hashes(prompt[: BLOCK - 1], BLOCK) == []


def test_index_matches_leading_blocks_and_evicts_tails_first():
    index = PrefixIndex(max_num_blocks=4)
    first = prefix_block_hashes(tokens(0, 3 * BLOCK), BLOCK)
    index.insert(first)
    assert index.num_matched_blocks(first) == 3
    assert index.num_matched_blocks(first[:1] + [12345]) == 1
    second = prefix_block_hashes(tokens(1, 2 * BLOCK), BLOCK)
    index.insert(second)  # 5 blocks > 4: the oldest tail goes, first's root stays
    assert len(index) == 4
    assert index.num_matched_blocks(first) == 2
    assert index.num_matched_blocks(second) == 2


# --- least outstanding tokens, leases, exclusion ------------------------------------------


def test_least_loaded_goes_to_the_fewest_outstanding_tokens():
    balancer = make_balancer()
    first = balancer.route(None, 300)
    second = balancer.route(None, 100)
    third = balancer.route(None, 200)
    assert [lease.name for lease in (first, second, third)] == ["a", "b", "c"]  # ties: pool order
    assert {lease.choice.reason for lease in (first, second, third)} == {"least_loaded"}
    assert loads(balancer) == {"a": 300, "b": 100, "c": 200}
    assert balancer.route(None, 500).name == "b"
    assert loads(balancer) == {"a": 300, "b": 600, "c": 200}


def test_ties_go_to_the_injected_rng():
    names = [make_balancer(rng=random.Random(seed)).pick(None, 10).name for seed in range(20)]
    assert set(names) == set(NAMES)


def test_lease_release_is_idempotent_and_the_context_manager_releases():
    balancer = make_balancer()
    lease = balancer.route(None, 300)
    lease.release()
    lease.release()
    assert lease.released and loads(balancer) == {"a": 0, "b": 0, "c": 0}
    with balancer.route(None, 50) as lease:
        assert {v.name: v.num_in_flight for v in balancer.views()} == {"a": 1, "b": 0, "c": 0}
    with pytest.raises(RuntimeError), balancer.route(None, 70):
        raise RuntimeError("the call failed")
    lease.release()
    assert loads(balancer) == {"a": 0, "b": 0, "c": 0}
    assert all(v.num_in_flight == 0 for v in balancer.views())


def test_pick_changes_nothing():
    balancer = make_balancer()
    prompt = tokens(0, 4 * BLOCK)
    choice = balancer.pick(prompt, 100)
    assert balancer.pick(prompt, 100) == choice
    assert loads(balancer) == {"a": 0, "b": 0, "c": 0}
    assert all(v.num_indexed_blocks == 0 for v in balancer.views())
    lease = balancer.acquire(choice)
    assert lease.name == choice.name and loads(balancer)[choice.name] == 100
    assert balancer.views()[0].num_indexed_blocks == 4


def test_exclude_skips_tried_replicas_and_says_retry():
    balancer = make_balancer()
    choice = balancer.pick(None, 10, exclude={"a"})
    assert (choice.name, choice.reason) == ("b", "retry")
    assert balancer.pick(None, 10, exclude={"a", "b"}).name == "c"
    with pytest.raises(NoReplicaAvailable) as raised:
        balancer.pick(None, 10, exclude=set(NAMES))
    assert raised.value.name_to_reason == {"a": "excluded", "b": "excluded", "c": "excluded"}
    assert raised.value.code == "no_replica_available" and raised.value.retry_after == 1.0


def test_unhealthy_replicas_are_skipped_with_their_reason(clock):
    healths = make_healths(clock)
    balancer = make_balancer(healths=healths)
    healths[0].record_probe(False, "connection refused")
    healths[1].record_failure()
    healths[1].record_failure()
    assert balancer.route(None, 10).name == "c"
    healths[2].record_failure()
    healths[2].record_failure()
    clock.advance(1.5)
    with pytest.raises(NoReplicaAvailable) as raised:
        balancer.route(None, 10)
    assert raised.value.name_to_reason == {"a": "down_by_probe", "b": "breaker_open", "c": "breaker_open"}
    assert raised.value.retry_after == pytest.approx(1.0)  # min(a's guess 1.0, b's and c's 3.5 s left)
    healths[0].record_probe(True)
    assert balancer.route(None, 10).name == "a"


def test_retry_after_is_the_cooldown_left_when_every_breaker_is_open(clock):
    healths = make_healths(clock, cooldown=8.0)
    balancer = make_balancer(healths=healths)
    for health in healths:
        health.record_failure()
        health.record_failure()
        clock.advance(1.0)
    with pytest.raises(NoReplicaAvailable) as raised:
        balancer.route(None, 10)
    assert raised.value.retry_after == pytest.approx(5.0)  # a opened 3 s ago


def test_lease_outcomes_feed_the_breaker_and_only_one_call_probes(clock):
    healths = make_healths(clock)
    balancer = make_balancer(healths=healths)
    for _ in range(2):
        with balancer.route(None, 10, exclude={"b", "c"}) as lease:
            lease.record_failure()
            lease.record_success()  # ignored: the first outcome counts
    assert healths[0].unavailable_reason is Unavailable.BREAKER_OPEN
    assert balancer.route(None, 10).name == "b"
    clock.advance(5.0)
    probe = balancer.route(None, 10, exclude={"b", "c"})  # a is half-open: this call is its probe
    assert probe.name == "a" and healths[0].unavailable_reason is Unavailable.HALF_OPEN_BUSY
    with pytest.raises(NoReplicaAvailable):
        balancer.route(None, 10, exclude={"b", "c"})
    probe.release()  # ended with no outcome (the client left): another call may probe
    probe = balancer.route(None, 10, exclude={"b", "c"})
    assert probe.name == "a"
    probe.record_success()
    probe.release()
    assert healths[0].unavailable_reason is None
    assert [balancer.route(None, 10, exclude={"b", "c"}).name for _ in range(3)] == ["a", "a", "a"]


def test_a_full_replica_is_skipped_and_a_full_pool_raises():
    balancer = Balancer(NAMES, BalancerConfig(max_in_flight=2), name_to_max_in_flight={"a": 1})
    leases = [balancer.route(None, 10) for _ in range(5)]
    assert sorted(lease.name for lease in leases) == ["a", "b", "b", "c", "c"]
    with pytest.raises(PoolFull) as raised:
        balancer.route(None, 10)
    assert raised.value.code == "pool_full" and raised.value.retry_after == 1.0
    leases[0].release()
    assert balancer.route(None, 10).name == leases[0].name


# --- prefix affinity and the load bound ---------------------------------------------------


def test_a_shared_prefix_returns_to_the_replica_that_has_it():
    balancer = make_balancer()
    system = tokens(0, 10 * BLOCK)
    first = balancer.route(system + tokens(1, 20), 300)
    assert first.choice.reason == "least_loaded" and first.choice.num_matched_tokens == 0
    balancer.route(None, 100)
    balancer.route(None, 50)  # b and c now carry 100 and 50: least loaded would say c
    again = balancer.route(system + tokens(2, 30), 300)
    assert (again.name, again.choice.reason, again.choice.num_matched_tokens) == (first.name, "affinity", 10 * BLOCK)


def test_a_shared_system_prompt_does_not_pile_onto_one_replica_while_another_idles():
    balancer = Balancer(["a", "b"], BalancerConfig(block_size=BLOCK), rng=random.Random(0))
    system = tokens(0, 12 * BLOCK)  # every call opens with it, as an agent's calls do
    leases = [balancer.route(system + tokens(i + 1, 20), len(system) + 20 + 64) for i in range(16)]
    names = [lease.name for lease in leases]
    assert names.count("a") == 8 and names.count("b") == 8, names
    # The first call's replica keeps the prefix's calls while the bound allows: two in a row.
    assert names[:2] == [names[0]] * 2
    loads_now = loads(balancer)
    num_tokens = len(system) + 20 + 64
    assert max(loads_now.values()) <= 1.5 * sum(loads_now.values()) / 2 + num_tokens


def test_a_match_below_the_threshold_goes_least_loaded():
    # A slack that keeps every call within the bound: only the match decides here.
    balancer = make_balancer(BalancerConfig(block_size=BLOCK, min_match_fraction=0.5, balance_slack_tokens=1000))
    shared = tokens(0, 2 * BLOCK)
    assert balancer.route(shared + tokens(1, 2 * BLOCK), 10).name == "a"
    choice = balancer.pick(shared + tokens(2, 3 * BLOCK), 10)  # 2 of 5 blocks: 40%
    assert (choice.name, choice.reason) == ("b", "least_loaded")
    choice = balancer.pick(shared + tokens(3, 2 * BLOCK), 10)  # 2 of 4 blocks: 50%
    assert (choice.name, choice.reason, choice.num_matched_tokens) == ("a", "affinity", 2 * BLOCK)


def test_affinity_spills_when_the_replica_would_pass_the_bound():
    balancer = make_balancer(BalancerConfig(block_size=BLOCK, balance_factor=1.5, balance_slack_tokens=0))
    prompt = tokens(0, 8 * BLOCK)
    balancer.route(prompt, 900)  # a: 900, holding the prefix
    balancer.route(None, 300)  # b: 300
    balancer.route(None, 300)  # c: 300
    # a + T <= bound = 1.5 * (1500 + T) / 3 + T  <=>  900 <= 750 + T / 2: within from T = 300
    choice = balancer.pick(prompt, 300)
    assert (choice.name, choice.reason, choice.num_matched_tokens) == ("a", "affinity", 8 * BLOCK)
    choice = balancer.pick(prompt, 298)  # 900 > 899
    assert (choice.name, choice.reason, choice.num_matched_tokens) == ("b", "least_loaded", 0)


def test_a_prefix_held_twice_goes_to_the_copy_within_the_bound():
    balancer = make_balancer(BalancerConfig(block_size=BLOCK, balance_factor=1.0, balance_slack_tokens=0))
    prompt = tokens(0, 8 * BLOCK)
    assert balancer.route(prompt, 300).name == "a"
    assert balancer.route(prompt, 300).name == "b"  # a: 600 > bound (600 / 3): no one fits, least loaded
    assert balancer.route(None, 300).name == "c"
    balancer.route(None, 300, exclude={"b", "c"})  # a: 600
    # bound = (1200 + 0) / 3 = 400: a (600) is over, b (300) within and holds the prefix too
    choice = balancer.pick(prompt, 0)
    assert (choice.name, choice.reason, choice.num_matched_tokens) == ("b", "affinity", 8 * BLOCK)


def test_a_prompt_without_token_ids_goes_least_loaded():
    balancer = make_balancer()
    balancer.route(tokens(0, 4 * BLOCK), 10)
    choice = balancer.pick(None, 10)
    assert (choice.name, choice.reason, choice.num_matched_tokens) == ("b", "least_loaded", 0)


def test_a_retry_keeps_affinity_to_a_second_copy():
    balancer = make_balancer(BalancerConfig(block_size=BLOCK, balance_factor=1.0, balance_slack_tokens=0))
    prompt = tokens(0, 8 * BLOCK)
    balancer.route(prompt, 300)  # a
    balancer.route(prompt, 300)  # spilled to b
    balancer.route(None, 900)  # c: 900, so b (310) is within the bound over b and c (605)
    choice = balancer.pick(prompt, 10, exclude={"a"})
    assert (choice.name, choice.reason, choice.num_matched_tokens) == ("b", "retry", 8 * BLOCK)


# --- the simulated shared-prefix workload -------------------------------------------------


class SimulatedPrefixCache:
    """A replica's engine prefix cache: an LRU of whole-prefix keys, capacity in blocks."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.prefix_keys: OrderedDict[tuple[int, ...], None] = OrderedDict()

    def run(self, prompt: list[int]) -> int:
        """The prompt's cached tokens; then the prompt is cached (tails evicted first)."""
        keys = [tuple(prompt[: end]) for end in range(BLOCK, len(prompt) + 1, BLOCK)]
        num_hit_blocks = 0
        while num_hit_blocks < len(keys) and keys[num_hit_blocks] in self.prefix_keys:
            num_hit_blocks += 1
        for key in reversed(keys):
            self.prefix_keys[key] = None
            self.prefix_keys.move_to_end(key)
        while len(self.prefix_keys) > self.num_blocks:
            self.prefix_keys.popitem(last=False)
        return num_hit_blocks * BLOCK


def shared_prefix_workload(seed: int = 0, num_requests: int = 600) -> list[tuple[list[int], int, float]]:
    """(prompt, num_tokens, duration): one of 8 system prompts of 200 tokens + a 10-60 token user
    message, max_tokens 64; one arrival a tick, each call running 10-30 ticks (~20 in flight)."""
    rng = random.Random(seed)
    system_prompts = [[rng.randrange(1000, 50000) for _ in range(200)] for _ in range(8)]
    workload = []
    for _ in range(num_requests):
        prompt = rng.choice(system_prompts) + [rng.randrange(1000, 50000) for _ in range(rng.randint(10, 60))]
        workload.append((prompt, len(prompt) + 64, rng.uniform(10.0, 30.0)))
    return workload


def simulate(workload, route) -> tuple[float, int]:
    """Run the workload through route(prompt, num_tokens, now) -> (replica name, release);
    return the simulated prefix-cache hit rate and the number of calls."""
    caches = {name: SimulatedPrefixCache(num_blocks=48) for name in NAMES}  # ~3 system prompts each
    in_flight: list[tuple[float, int]] = []  # (end tick, call index) heap
    releases = {}
    num_hit_tokens = num_prompt_tokens = 0
    for now, (prompt, num_tokens, duration) in enumerate(workload):
        while in_flight and in_flight[0][0] <= now:
            releases.pop(heapq.heappop(in_flight)[1])()
        name, release = route(prompt, num_tokens)
        num_hit_tokens += caches[name].run(prompt)
        num_prompt_tokens += len(prompt)
        heapq.heappush(in_flight, (now + duration, now))
        releases[now] = release
    for release in releases.values():
        release()
    return num_hit_tokens / num_prompt_tokens, len(workload)


@pytest.mark.parametrize("config", [
    BalancerConfig(block_size=BLOCK),  # the defaults: factor 1.5, no slack beyond the call's own tokens
    BalancerConfig(block_size=BLOCK, balance_factor=1.5, balance_slack_tokens=512),  # slack ~ 1.5 calls
], ids=["default-bound", "tight-bound"])
def test_prefix_affinity_beats_round_robin_within_the_load_bound(config):
    balancer = Balancer(NAMES, config, rng=random.Random(0))
    reasons: list[str] = []
    excess_over_bound: list[float] = []  # of the chosen replica, after each placement

    def route_affinity(prompt, num_tokens):
        before = loads(balancer)
        bound = (config.balance_factor * (sum(before.values()) + num_tokens) / len(NAMES) + num_tokens
                 + config.balance_slack_tokens)
        lease = balancer.route(prompt, num_tokens)
        reasons.append(lease.choice.reason)
        excess_over_bound.append(loads(balancer)[lease.name] - bound)
        return lease.name, lease.release

    round_robin = iter(NAMES * 1000)

    def route_round_robin(prompt, num_tokens):
        return next(round_robin), lambda: None

    workload = shared_prefix_workload()
    affinity_hit_rate, _ = simulate(workload, route_affinity)
    round_robin_hit_rate, _ = simulate(workload, route_round_robin)
    least_loaded = Balancer(NAMES, config, rng=random.Random(0))

    def route_least_loaded(prompt, num_tokens):
        lease = least_loaded.route(None, num_tokens)  # no token ids: no affinity
        return lease.name, lease.release

    least_loaded_hit_rate, _ = simulate(workload, route_least_loaded)
    print(f"\nbalance_factor {config.balance_factor}, slack {config.balance_slack_tokens}: "
          f"prefix-cache hit rate over {len(workload)} calls, 3 replicas: affinity {affinity_hit_rate:.1%}, "
          f"round robin {round_robin_hit_rate:.1%}, least loaded {least_loaded_hit_rate:.1%}; "
          f"affinity reasons {reasons.count('affinity')}, least loaded {reasons.count('least_loaded')}; "
          f"closest approach to the bound {max(excess_over_bound):+.0f} tokens")
    assert affinity_hit_rate >= 2 * round_robin_hit_rate
    assert affinity_hit_rate >= 1.75 * least_loaded_hit_rate
    assert affinity_hit_rate > 0.6
    assert max(excess_over_bound) <= 0  # no placement ever put a replica above the bound
    assert all(v.num_outstanding_tokens == 0 for v in balancer.views())  # every lease came back


# --- the bounded queue --------------------------------------------------------------------


def one_slot_pool(**kwargs) -> Balancer:
    return Balancer(("a",), BalancerConfig(max_in_flight=1, **kwargs))


def test_a_full_pool_waits_then_gets_the_freed_slot_in_fifo_order():
    balancer = one_slot_pool()

    async def main() -> list[str]:
        held = await balancer.acquire_slot(None, 10)
        order: list[str] = []

        async def call(label: str) -> None:
            with await balancer.acquire_slot(None, 10, timeout=10.0):
                order.append(label)
                await asyncio.sleep(0)

        tasks = [asyncio.create_task(call(label)) for label in ("first", "second", "third")]
        await asyncio.sleep(0.01)
        assert balancer.num_waiting == 3 and order == []
        held.release()
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=10.0)
        return order

    assert asyncio.run(main()) == ["first", "second", "third"]
    assert balancer.num_waiting == 0 and balancer.views()[0].num_in_flight == 0


def test_a_waiter_times_out_as_pool_full_and_a_full_queue_refuses_at_once():
    balancer = one_slot_pool(max_queue=1)

    async def main() -> None:
        held = await balancer.acquire_slot(None, 10)
        waiting = asyncio.create_task(balancer.acquire_slot(None, 10, timeout=0.05))
        await asyncio.sleep(0)
        with pytest.raises(PoolFull, match="queued"):
            await balancer.acquire_slot(None, 10)
        with pytest.raises(PoolFull, match="stayed full"):
            await waiting
        held.release()

    asyncio.run(main())
    assert balancer.num_waiting == 0 and balancer.views()[0].num_in_flight == 0


def test_a_cancelled_waiter_leaks_nothing():
    balancer = one_slot_pool()

    async def main() -> str:
        held = await balancer.acquire_slot(None, 10)
        cancelled = asyncio.create_task(balancer.acquire_slot(None, 10, timeout=10.0))
        behind = asyncio.create_task(balancer.acquire_slot(None, 20, timeout=10.0))
        await asyncio.sleep(0)
        held.release()  # wakes both; the first is cancelled before it runs
        cancelled.cancel()
        lease = await asyncio.wait_for(behind, timeout=10.0)
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        assert balancer.num_waiting == 0
        assert balancer.views()[0].num_outstanding_tokens == 20
        lease.release()
        return (await balancer.acquire_slot(None, 30)).name

    assert asyncio.run(main()) == "a"
    assert balancer.views()[0].num_in_flight == 1 and balancer.views()[0].num_outstanding_tokens == 30


def test_a_call_with_nowhere_to_go_fails_at_once_even_behind_a_queue():
    balancer = Balancer(("a", "b"), BalancerConfig(max_in_flight=1))

    async def main() -> None:
        held = [await balancer.acquire_slot(None, 10), await balancer.acquire_slot(None, 10)]
        waiting = asyncio.create_task(balancer.acquire_slot(None, 10, timeout=10.0))
        await asyncio.sleep(0)
        assert balancer.num_waiting == 1
        with pytest.raises(NoReplicaAvailable):  # a retry that has tried both: no point queueing
            await balancer.acquire_slot(None, 10, exclude={"a", "b"})
        assert balancer.num_waiting == 1
        held[0].release()
        (await asyncio.wait_for(waiting, timeout=10.0)).release()
        held[1].release()

    asyncio.run(main())
    assert all(v.num_in_flight == 0 for v in balancer.views())


def test_a_waiter_hears_its_pool_go_down(clock):
    health = ReplicaHealth("a", CircuitBreaker(clock=clock))
    balancer = Balancer(("a",), BalancerConfig(max_in_flight=1), name_to_health={"a": health})

    async def main() -> None:
        held = await balancer.acquire_slot(None, 10)
        waiting = asyncio.create_task(balancer.acquire_slot(None, 10, timeout=10.0))
        await asyncio.sleep(0)
        health.record_probe(False)
        with pytest.raises(NoReplicaAvailable):
            await asyncio.wait_for(waiting, timeout=10.0)
        held.release()

    asyncio.run(main())
    assert balancer.num_waiting == 0


def test_a_waiter_gets_a_replica_that_comes_back_up(clock):
    healths = [ReplicaHealth(name, CircuitBreaker(clock=clock)) for name in ("a", "b")]
    balancer = Balancer(("a", "b"), BalancerConfig(max_in_flight=1), name_to_health={h.name: h for h in healths})

    async def main() -> str:
        healths[1].record_probe(False)
        await balancer.acquire_slot(None, 10)  # a, held to the end
        waiting = asyncio.create_task(balancer.acquire_slot(None, 10, timeout=10.0))
        await asyncio.sleep(0)
        healths[1].record_probe(True)
        return (await asyncio.wait_for(waiting, timeout=10.0)).name

    assert asyncio.run(main()) == "b"
