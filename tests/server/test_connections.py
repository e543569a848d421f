"""ConnectionTable's bookkeeping and eviction order, and ConnectionPolicy's checks and caps
(server/connections.py). The protocol that drives them is tested on a real server in
tests/e2e/test_slowloris.py."""

from __future__ import annotations

import pytest

from tokenway.server.connections import ConnectionPolicy, ConnectionTable, default_max_connections


class Conn:
    """A connection the table can evict; `evicted` says whether it was."""

    def __init__(self, name: str) -> None:
        self.name, self.evicted = name, False

    def evict(self) -> None:
        assert not self.evicted, f"{self.name} evicted twice"
        self.evicted = True

    def __repr__(self) -> str:
        return self.name


def make_table(max_connections: int = 4, per_client: int = 4) -> ConnectionTable:
    return ConnectionTable(max_connections, per_client)


def admit(table: ConnectionTable, name: str, client: str = "10.0.0.1", now: float = 0.0) -> Conn:
    conn = Conn(name)
    assert table.admit(conn, client, now)
    return conn


def test_at_the_cap_the_oldest_opening_connection_makes_room():
    table = make_table(max_connections=3)
    a, b, c = (admit(table, name, now=i) for i, name in enumerate("abc"))
    d = admit(table, "d", now=3)
    assert a.evicted and not (b.evicted or c.evicted or d.evicted)
    assert (table.num_connections, table.num_evicted, table.num_refused) == (3, 1, 0)
    admit(table, "e", now=4)
    assert b.evicted and not c.evicted


def test_opening_connections_go_before_idle_ones_and_active_ones_never():
    table = make_table(max_connections=3)
    idle, active, opening = admit(table, "idle"), admit(table, "active"), admit(table, "opening")
    table.mark_active(idle)
    table.mark_idle(idle)  # answered: older than `opening`, but it has shown it is a client
    table.mark_active(active)
    newer = admit(table, "newer")
    assert opening.evicted and not idle.evicted
    table.mark_active(newer)  # nothing is opening now: the idle one is next
    admit(table, "newest")
    assert idle.evicted and not active.evicted and not newer.evicted
    assert table.num_evicted == 2


def test_past_the_opening_cap_the_oldest_opening_one_goes_even_below_the_caps():
    table = ConnectionTable(max_connections=10, max_connections_per_client=10, max_opening_connections=2)
    a, b = admit(table, "a"), admit(table, "b")
    table.mark_active(a)  # active ones do not count as opening
    c = admit(table, "c")
    assert not (a.evicted or b.evicted or c.evicted)
    d = admit(table, "d")
    assert b.evicted and not (c.evicted or d.evicted)
    assert (table.num_connections, table.num_waiting, table.num_evicted) == (3, 2, 1)


def test_every_connection_active_refuses_the_new_one():
    table = make_table(max_connections=2)
    for conn in (admit(table, "a"), admit(table, "b")):
        table.mark_active(conn)
    assert not table.admit(Conn("c"), "10.0.0.1", 0.0)
    assert (table.num_connections, table.num_refused) == (2, 1)


def test_a_client_at_its_cap_displaces_only_its_own_connections():
    table = make_table(max_connections=10, per_client=2)
    mine = [admit(table, f"mine{i}", client="10.0.0.2", now=i) for i in range(2)]
    theirs = admit(table, "theirs", client="10.0.0.3", now=0)
    mine.append(admit(table, "mine2", client="10.0.0.2", now=3))
    assert mine[0].evicted and not mine[1].evicted and not theirs.evicted
    assert table.num_connections_of("10.0.0.2") == 2 and table.num_connections_of("10.0.0.3") == 1
    for conn in mine[1:]:
        table.mark_active(conn)
    # Both of 10.0.0.2's connections are active now: its next one is refused, others' are not.
    assert not table.admit(Conn("mine3"), "10.0.0.2", 5.0)
    admit(table, "theirs2", client="10.0.0.3")
    assert table.num_refused == 1


def test_close_expired_closes_opening_connections_accepted_before_the_deadline_only():
    table = make_table(max_connections=10)
    old, active, young = admit(table, "old", now=1.0), admit(table, "active", now=1.5), admit(table, "young", now=3.0)
    table.mark_active(active)
    idle = admit(table, "idle", now=0.5)
    table.mark_active(idle)
    table.mark_idle(idle)  # idle ones are uvicorn's keep-alive timer's to close
    assert table.close_expired(accepted_before=2.0) == 1
    assert old.evicted and not (active.evicted or young.evicted or idle.evicted)
    assert (table.num_expired, table.num_evicted, table.num_connections) == (1, 0, 3)
    assert table.close_expired(accepted_before=2.0) == 0


def test_remove_forgets_a_connection_in_every_state_once():
    table = make_table(max_connections=10, per_client=10)
    conns = [admit(table, name) for name in ("opening", "active", "idle")]
    table.mark_active(conns[1])
    table.mark_active(conns[2])
    table.mark_idle(conns[2])
    for conn in conns + conns:  # the second round: closed already, a no-op
        table.remove(conn)
    assert (table.num_connections, table.num_waiting, table.num_connections_of("10.0.0.1")) == (0, 0, 0)
    table.mark_idle(conns[0])  # a closed connection's late callback changes nothing
    assert table.num_waiting == 0
    assert not any(conn.evicted for conn in conns)


def test_a_connection_idle_again_keeps_its_place_in_line():
    table = make_table(max_connections=3)
    a, b = admit(table, "a"), admit(table, "b")
    for conn in (a, b):
        table.mark_active(conn)
        table.mark_idle(conn)
    table.mark_idle(a)  # idle already: not moved behind b
    table.mark_active(admit(table, "c"))
    admit(table, "d")
    assert a.evicted and not b.evicted


def test_policy_checks_and_derived_caps():
    with pytest.raises(ValueError, match="header_timeout_seconds"):
        ConnectionPolicy(header_timeout_seconds=0)
    with pytest.raises(ValueError, match="max_connections_per_client"):
        ConnectionPolicy(max_connections_per_client=0)
    resolved = ConnectionPolicy().resolved(num_fds=20_000)
    assert (resolved.max_connections, resolved.max_connections_per_client, resolved.max_opening_connections) == (
        18_000, 4_500, 4_096)
    assert ConnectionPolicy().resolved(num_fds=1024).max_opening_connections == 512
    assert default_max_connections(1024) == 512 and default_max_connections(10**7) == 65_536
    assert ConnectionPolicy(max_connections=100, max_connections_per_client=500).resolved(20_000) \
        .max_connections_per_client == 100
    with pytest.raises(ValueError, match="RLIMIT_NOFILE"):
        ConnectionPolicy(max_connections=19_900).resolved(num_fds=20_000)
    options = {"header_timeout_seconds": 2.5, "max_connections": None, "model": "m"}
    assert ConnectionPolicy.from_options(options) == ConnectionPolicy(header_timeout_seconds=2.5)
