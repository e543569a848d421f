"""EngineStats: the payload's keys in field order, the pickle that crosses the engine process's
pipe, and the JSON parse a gateway applies to a worker's state."""

from __future__ import annotations

import dataclasses
import json
import pickle

import pytest

from tokenway.engine.stats import ClassStats, EngineStats
from tokenway.protocol.job import SERVICE_CLASSES

COUNTS = dict(num_running=2, num_waiting=1, kv_blocks_total=100, kv_blocks_free=75, prefix_cache_hit_rate=0.25,
              prefix_cache_queried_tokens=400, prefix_cache_hit_tokens=100, num_preemptions=4, num_steps=9,
              spec_decode_num_drafts=3, spec_decode_num_draft_tokens=12, spec_decode_num_accepted_tokens=6,
              spec_decode_acceptance_rate=0.5, spec_decode_mean_accepted_length=3.0, num_interjected_steps=2)
STATS = EngineStats(**COUNTS)
IN_A_PROCESS = dataclasses.replace(STATS, engine_pid=4242, engine_restarts=0)


def test_the_payload_is_every_count_in_field_order_and_the_process_only_where_there_is_one():
    assert list(STATS.to_dict().items()) == list(COUNTS.items())
    # A process that never restarted still says so: 0 is not absent.
    assert list(IN_A_PROCESS.to_dict().items()) == [*COUNTS.items(), ("engine_pid", 4242), ("engine_restarts", 0)]
    # Between an engine process's death and its restart, the pid is None and the restarts still show.
    assert dataclasses.replace(IN_A_PROCESS, engine_pid=None).to_dict() == {
        **COUNTS, "engine_pid": None, "engine_restarts": 0}


def test_it_pickles_whole_and_stays_frozen():
    for stats in (STATS, IN_A_PROCESS):
        assert pickle.loads(pickle.dumps(stats, protocol=pickle.HIGHEST_PROTOCOL)) == stats
    with pytest.raises(dataclasses.FrozenInstanceError):
        STATS.num_running = 3  # type: ignore[misc]


@pytest.mark.parametrize("stats", [STATS, IN_A_PROCESS], ids=["thread", "process"])
def test_from_dict_reads_back_what_to_dict_wrote_through_json(stats):
    assert EngineStats.from_dict(json.loads(json.dumps(stats.to_dict()))) == stats


def test_from_dict_takes_a_whole_number_for_a_rate_and_ignores_counts_it_does_not_know():
    parsed = EngineStats.from_dict({**COUNTS, "prefix_cache_hit_rate": 0, "num_speculators": 2})
    assert parsed == dataclasses.replace(STATS, prefix_cache_hit_rate=0)


@pytest.mark.parametrize(("payload", "message"), [
    ({**COUNTS, "num_steps": None}, "num_steps: expected int, got NoneType"),
    ({key: value for key, value in COUNTS.items() if key != "num_steps"}, "num_steps: missing"),
    ({**COUNTS, "num_running": True}, "num_running: expected int, got bool"),
    ({**COUNTS, "num_running": 2.0}, "num_running: expected int, got float"),
    ({**COUNTS, "prefix_cache_hit_rate": "0.25"}, "prefix_cache_hit_rate: expected float or int, got str"),
    ({**COUNTS, "engine_pid": "4242"}, "engine_pid: expected int or NoneType, got str"),
], ids=["null", "missing", "bool", "float-for-int", "string-rate", "string-pid"])
def test_from_dict_names_the_first_count_that_is_missing_or_of_the_wrong_type(payload, message):
    with pytest.raises(ValueError, match=f"^{message}$"):
        EngineStats.from_dict(payload)


CLASSES = tuple(ClassStats(name, rank, 2 * rank, 3, 40 + rank, 50) for rank, name in enumerate(SERVICE_CLASSES))
WITH_CLASSES = dataclasses.replace(IN_A_PROCESS, classes=CLASSES)


def test_the_counts_per_class_are_an_object_by_class_after_the_engines_and_cross_json_and_the_pipe():
    payload = WITH_CLASSES.to_dict()
    engine_counts = [name for name in COUNTS if name != "num_interjected_steps"]
    assert list(payload) == [*engine_counts, "classes", "num_interjected_steps", "engine_pid", "engine_restarts"]
    assert payload["classes"]["batch"] == {"num_running": 3, "num_waiting": 6, "num_preemptions": 3,
                                           "num_prompt_tokens": 43, "num_generated_tokens": 50}
    assert list(payload["classes"]) == ["priority", "default", "flex", "batch"]
    assert EngineStats.from_dict(json.loads(json.dumps(payload))) == WITH_CLASSES
    assert pickle.loads(pickle.dumps(WITH_CLASSES)) == WITH_CLASSES
    assert WITH_CLASSES.of_class("flex") == CLASSES[2] and STATS.of_class("flex") is None


@pytest.mark.parametrize(("classes", "message"), [
    ([], "classes: expected an object, got list"),
    ({"priority": {}}, "classes.priority.num_running: missing"),
    ({name: CLASSES[0].to_dict() for name in ("priority", "default", "batch")}, "classes.flex: missing"),
    ({name: {**CLASSES[0].to_dict(), "num_waiting": 1.0} for name in SERVICE_CLASSES},
     "classes.priority.num_waiting: expected int, got float"),
    ({name: 7 for name in SERVICE_CLASSES}, "classes.priority: expected an object, got int"),
], ids=["list", "missing-count", "missing-class", "float", "not-an-object"])
def test_malformed_counts_per_class_are_named(classes, message):
    with pytest.raises(ValueError, match=f"^{message}$"):
        EngineStats.from_dict({**COUNTS, "classes": classes})


def test_a_class_it_does_not_know_is_ignored_and_an_engine_without_classes_reads_as_none():
    payload = {**COUNTS, "classes": {**WITH_CLASSES.to_dict()["classes"], "platinum": {"num_running": 1}}}
    assert EngineStats.from_dict(payload).classes == CLASSES
    assert EngineStats.from_dict(COUNTS).classes is None
