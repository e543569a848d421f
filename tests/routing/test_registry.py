"""The model registry from config: the example file, the defaults without [[models]], alias and
fallback resolution, and each validation error with the path it names."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from tokenway.billing.pricing import ModelPrice
from tokenway.config import DEFAULT_MODEL
from tokenway.routing.balancer import BalancerConfig
from tokenway.routing.health import BreakerConfig, HealthCheckConfig
from tokenway.routing.registry import (
    DEFAULT_EMBEDDING_MODEL,
    REGISTRY_KEYS,
    ModelNotFound,
    Registry,
    ServedModel,
    default_served_name,
)
from tokenway.routing.registry_config import ModelEntry, ModelTimeouts, ReplicaSpec

EXAMPLE = Path(__file__).parents[2] / "examples" / "gateway.toml"
LOCAL = {"kind": "local"}
WORKER = {"kind": "worker", "url": "http://10.0.0.1:8100"}


def model(name: str = "m", *replicas: dict, **keys) -> dict:
    return {"name": name, "replicas": list(replicas or [LOCAL]), **keys}


def load(*models: dict, **top) -> Registry:
    return Registry.from_config({"models": list(models), **top}, default_model=DEFAULT_MODEL)


def names(entries) -> list[str]:
    return [entry.name for entry in entries]


# ---- the example file ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def example() -> Registry:
    return Registry.load(EXAMPLE, default_model=DEFAULT_MODEL)


def test_example_resolves_names_and_aliases(example):
    assert names(example.models) == ["small", "large", "claude-sonnet", "all-minilm-l6-v2"]
    assert example.implicit_names == frozenset()  # it lists its own embeddings model
    assert example.resolve("gpt-4o-mini") is example.resolve("small")
    assert example.resolve("gpt-4o").name == "large"
    assert example.resolve("claude-sonnet-4-5").name == "claude-sonnet"
    assert example.resolve("sentence-transformers/all-MiniLM-L6-v2").kind == "embeddings"


def test_example_pools(example):
    small, large, claude, minilm = example.models
    assert small.local_replica == ReplicaSpec("local", "local", model=DEFAULT_MODEL)  # serve's --model
    assert small.balancer.max_in_flight == 128 and small.timeouts.deadline == 60.0
    assert large.replicas == (
        ReplicaSpec("worker", "10.0.0.11:8100", url="http://10.0.0.11:8100", secret_env="TOKENWAY_WORKER_SECRET"),
        ReplicaSpec("worker", "10.0.0.12:8100", url="http://10.0.0.12:8100", secret_env="TOKENWAY_WORKER_SECRET"),
        ReplicaSpec("openai", "vllm", url="http://10.0.0.20:8000/v1", model="Qwen/Qwen2.5-7B-Instruct",
                    api_key_env="VLLM_API_KEY", max_in_flight=64),
    )
    assert large.name_to_max_in_flight == {"vllm": 64}  # the workers take balancer.max_in_flight, 32
    assert large.balancer == BalancerConfig(balance_factor=1.25, min_match_fraction=0.5, max_queue=256,
                                            queue_timeout=10.0, max_in_flight=32)
    assert large.breaker == BreakerConfig(failure_threshold=5, failure_window=10.0, cooldown=5.0)
    assert large.health == HealthCheckConfig(interval=1.0, timeout=2.0)
    assert large.timeouts == ModelTimeouts(deadline=300.0, first_token=60.0, between_tokens=30.0)
    assert large.price == ModelPrice(input=0.5, cached_input=0.25, output=1.5)
    assert claude.replicas == (ReplicaSpec("anthropic", "api.anthropic.com", url="https://api.anthropic.com/v1",
                                           model="claude-sonnet-4-5", api_key_env="ANTHROPIC_API_KEY"),)
    assert minilm.local_replica == ReplicaSpec("local", "local")  # model None: the packaged one
    assert example.local_models() == (small, minilm)
    assert example.local_model("chat") is small and example.local_model("embeddings") is minilm


def test_example_fallbacks(example):
    assert names(example.fallback_chain("gpt-4o")) == ["large", "claude-sonnet"]
    assert names(example.fallback_chain("small")) == ["small"]


def test_example_top_level_keys_are_serve_flags_or_the_registrys():
    from tokenway.cli import SERVE_OPTIONS

    data = tomllib.loads(EXAMPLE.read_text())
    assert set(data) - REGISTRY_KEYS <= set(SERVE_OPTIONS)  # what load_config_file must accept


def test_example_env_keys_missing(example, monkeypatch):
    for name in ("ANTHROPIC_API_KEY", "TOKENWAY_WORKER_SECRET", "VLLM_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    assert example.env_keys_missing() == ["ANTHROPIC_API_KEY", "TOKENWAY_WORKER_SECRET", "VLLM_API_KEY"]
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-ant-secret")
    monkeypatch.setenv("VLLM_API_KEY", "  ")  # blank is unset, as the upstreams read it
    assert example.env_keys_missing() == ["TOKENWAY_WORKER_SECRET", "VLLM_API_KEY"]
    assert example.env_keys_missing({"TOKENWAY_WORKER_SECRET": "s", "VLLM_API_KEY": "k"}) == ["ANTHROPIC_API_KEY"]


def test_example_served_names_round_trip(example):
    served = example.served_names()
    assert served[0] == ServedModel("small", ("gpt-4o-mini", "smollm2-135m-instruct"), "chat", None)
    assert served[1].context_window == 32768
    for entry in served:  # every listed name and alias resolves to the model listed with it
        for name in (entry.name, *entry.aliases):
            assert example.resolve(name).name == entry.name
    assert sum(1 + len(entry.aliases) for entry in served) == len({n for e in served for n in (e.name, *e.aliases)})


def test_example_upstream_timeouts(example):
    timeouts = example.resolve("large").upstream_timeouts()
    assert (timeouts.connect, timeouts.first_event, timeouts.between_events, timeouts.total, timeouts.probe) == (
        10.0, 60.0, 30.0, 300.0, 2.0)


# ---- lookups -------------------------------------------------------------------------------------


def test_unknown_model_is_a_key_error_naming_it(example):
    assert example.get("gpt-5") is None
    with pytest.raises(KeyError) as exc_info:
        example.resolve("gpt-5")
    assert isinstance(exc_info.value, ModelNotFound) and exc_info.value.model == "gpt-5"
    assert str(exc_info.value) == "The model 'gpt-5' does not exist."
    with pytest.raises(ModelNotFound):
        example.fallback_chain("gpt-5")


def test_fallback_chain_is_breadth_first_through_aliases():
    registry = load(model("a", WORKER, fallbacks=["b", "c-alias"]), model("b", WORKER, fallbacks=["d"]),
                    model("c", WORKER, aliases=["c-alias"], fallbacks=["d"]), model("d"))
    assert names(registry.fallback_chain("a")) == ["a", "b", "c", "d"]  # a's own in order, then theirs, d once
    assert names(registry.fallback_chain("c-alias")) == ["c", "d"]


def test_price_table_joins_model_prices_and_the_top_level_table(example):
    assert example.price_table().price("large") == ModelPrice(0.5, 0.25, 1.5)
    registry = load(model("a"), model("b", WORKER, aliases=["b2"], prices={"output": 3}))
    table = registry.price_table({"a": {"input": 2.0}, "retired-model": {"output": 1.0}})
    assert table.price("a") == ModelPrice(input=2.0)
    assert table.price("b") == ModelPrice(output=3.0)
    assert table.price("retired-model") == ModelPrice(output=1.0)  # kept, as before the registry
    table = load(model("a", aliases=["gpt-4o-mini"])).price_table({"gpt-4o-mini": {"input": 1.0}})
    assert "a" in table and "gpt-4o-mini" not in table  # by alias: the ledger bills the model's name


def test_price_table_refuses_a_model_priced_twice(example):
    with pytest.raises(ValueError, match=r"^prices.gpt-4o: model 'large' is priced in its \[\[models\]\] entry"):
        example.price_table({"gpt-4o": {"input": 1.0}})
    with pytest.raises(ValueError, match=r"^prices.x: model 'a' is priced already, as prices.a$"):
        load(model("a", aliases=["x"])).price_table({"a": {"input": 1.0}, "x": {"input": 2.0}})


# ---- defaults ------------------------------------------------------------------------------------


def test_no_models_table_serves_the_default_model_and_embeddings():
    registry = Registry.from_config({"port": 9000}, default_model=DEFAULT_MODEL)
    chat, embeddings = registry.models
    assert chat == ModelEntry(DEFAULT_MODEL, (ReplicaSpec("local", model=DEFAULT_MODEL),))
    assert embeddings == ModelEntry(DEFAULT_EMBEDDING_MODEL, (ReplicaSpec("local"),), "embeddings")
    assert registry.implicit_names == {DEFAULT_MODEL, DEFAULT_EMBEDDING_MODEL}
    assert registry.local_models() == (chat, embeddings)
    assert registry.env_keys_missing({}) == []
    assert names(registry.fallback_chain(DEFAULT_MODEL)) == [DEFAULT_MODEL]


def test_served_model_names_are_the_default_models_name_and_aliases():
    registry = Registry.from_config({"embeddings": False}, default_model="/models/Qwen2.5-0.5B-Instruct",
                                    served_model_names=["qwen", "gpt-4o-mini"])
    (entry,) = registry.models
    assert (entry.name, entry.aliases, entry.local_replica.model) == (
        "qwen", ("gpt-4o-mini",), "/models/Qwen2.5-0.5B-Instruct")
    assert registry.get(DEFAULT_EMBEDDING_MODEL) is None


@pytest.mark.parametrize(("model_arg", "name"), [
    (DEFAULT_MODEL, DEFAULT_MODEL), ("./weights/my-model.gguf", "my-model"),
    ("/models/Qwen2.5-0.5B-Instruct/", "Qwen2.5-0.5B-Instruct"),
])
def test_default_served_name(model_arg, name):
    assert default_served_name(model_arg) == name


def test_models_without_embeddings_get_the_default_one_unless_switched_off():
    assert names(load(model("a")).models) == ["a", DEFAULT_EMBEDDING_MODEL]
    assert load(model("a")).implicit_names == {DEFAULT_EMBEDDING_MODEL}
    assert names(load(model("a"), embeddings=False).models) == ["a"]
    own = load(model("a"), model("e5", {"kind": "openai", "url": "http://tei:8080/v1"}, kind="embeddings"))
    assert names(own.models) == ["a", "e5"] and own.resolve("e5").replicas[0].model == "e5"


def test_a_remote_only_gateway_runs_no_local_engine():
    registry = load(model("a", WORKER), embeddings=False)
    assert registry.local_models() == () and registry.local_model("chat") is None


def test_a_local_replica_may_name_its_own_model():
    registry = load(model("m", {"kind": "local", "model": "./weights/m.gguf"}))
    assert registry.local_model("chat").local_replica.model == "./weights/m.gguf"  # over serve's --model


def test_the_embeddings_model_published_by_the_package_is_the_default():
    pytest.importorskip("torch")
    from tokenway.embeddings.model import DEFAULT_EMBEDDING_MODEL as PACKAGE_DEFAULT

    assert DEFAULT_EMBEDDING_MODEL == PACKAGE_DEFAULT


def test_load_names_the_file(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[[models]]\nname = 'a'\nreplicas = [{kind = 'local', url = 'http://x'}]\n")
    with pytest.raises(ValueError, match=rf"^{path}: models\[0\].replicas\[0\]: unknown key 'url' for a local"):
        Registry.load(path, default_model=DEFAULT_MODEL)
    path.write_text("[[models]\n")
    with pytest.raises(ValueError, match=rf"^{path}: "):
        Registry.load(path, default_model=DEFAULT_MODEL)
    with pytest.raises(ValueError, match=r"cannot read the config file: No such file"):
        Registry.load(tmp_path / "missing.toml", default_model=DEFAULT_MODEL)


# ---- validation: each mistake, and the key it names ----------------------------------------------

OPENAI = {"kind": "openai", "url": "http://10.0.0.2:8000/v1"}

ERRORS = [
    # keys
    ([model(context_windw=4096)], {},
     ("models[0]: unknown key 'context_windw' (did you mean 'context_window'?); known: aliases, balancer, "
      "between_tokens_timeout_s, breaker, cache, connect_timeout_s, context_window, fallbacks, first_token_timeout_s, "
      "health, kind, max_in_flight, name, prices, replicas, safety, timeout_s")),
    ([model("m", {"kind": "worker", "url": "http://h:8100", "api_key_env": "K"})], {},
     ("models[0].replicas[0]: unknown key 'api_key_env' for a worker replica; known: kind, max_in_flight, name, "
      "secret_env, url")),
    ([model("m", {"kind": "worker", "url": "http://h:8100", "model": "x"})], {},
     ("models[0].replicas[0]: unknown key 'model' for a worker replica; known: kind, max_in_flight, name, "
      "secret_env, url")),
    ([model(balancer={"max_in_flight": 8})], {},
     ("models[0].balancer: unknown key 'max_in_flight' (it is the model's own key, max_in_flight); known: "
      "balance_factor, balance_slack_tokens, block_size, max_num_indexed_blocks, max_queue, min_match_fraction, "
      "policy, queue_timeout_s, retry_after_s")),
    ([model(prices={"input": 1, "outptu": 2})], {},
     "models[0].prices: unknown key 'outptu' (did you mean 'output'?); known: batch, cached_input, "
     "cached_response, flex, input, output, priority"),
    ([model(**{"context-window": 1, "context_window": 2})], {},
     "models[0]: 'context_window' is given twice (with - and with _)"),
    ([{"replicas": [LOCAL]}], {}, "models[0].name: required"),
    ([{"name": "m"}], {}, "models[0].replicas: required"),
    ([model("m", {"url": "http://h:8100"})], {}, "models[0].replicas[0].kind: required"),
    ([], {}, "models: must be one or more [[models]] tables (leave it out for the default model)"),
    ("gpt", {}, "models: must be one or more [[models]] tables (leave it out for the default model)"),
    ([model(), "x"], {}, "models[1]: must be a table, got str 'x'"),
    ([model()], {"embeddings": "no"}, "embeddings: must be true or false, got 'no'"),
    ([model(), model("e", kind="embeddings")], {"embeddings": False},
     "embeddings: false, but models[1] is an embeddings model; drop one of the two"),
    # kinds
    ([model(kind="completion")], {}, "models[0].kind: must be one of chat, embeddings, got 'completion'"),
    ([model("m", {"kind": "vllm"})], {},
     "models[0].replicas[0].kind: must be one of local, worker, openai, anthropic, responses, got 'vllm'"),
    ([model("m", WORKER, kind="embeddings")], {},
     "models[0].replicas[0].kind: a worker replica cannot serve an embeddings model; use local or openai"),
    # numbers
    ([model(context_window=0)], {}, "models[0].context_window: must be an integer >= 1, got 0"),
    ([model(max_in_flight=8.0)], {}, "models[0].max_in_flight: must be an integer >= 1, got 8.0"),
    ([model(max_in_flight=True)], {}, "models[0].max_in_flight: must be an integer >= 1, got True"),
    ([model("m", dict(WORKER, max_in_flight=-1))], {},
     "models[0].replicas[0].max_in_flight: must be an integer >= 1, got -1"),
    ([model(timeout_s=0)], {}, "models[0].timeout_s: must be a number of seconds > 0, got 0"),
    ([model(first_token_timeout_s="30")], {},
     "models[0].first_token_timeout_s: must be a number of seconds > 0, got '30'"),
    ([model(prices={"output": float("inf")})], {},
     "models[0].prices.output: must be a number (USD per million tokens) >= 0, got inf"),
    ([model(prices={"input": -0.1})], {},
     "models[0].prices.input: must be a number (USD per million tokens) >= 0, got -0.1"),
    ([model(balancer={"balance_factor": 0.5})], {},
     "models[0].balancer.balance_factor: must be a number >= 1, got 0.5"),
    ([model(balancer={"min_match_fraction": 2})], {},
     "models[0].balancer.min_match_fraction: must be a number >= 0 and <= 1, got 2"),
    ([model(breaker={"cooldown_s": -5})], {}, "models[0].breaker.cooldown_s: must be a number of seconds > 0, got -5"),
    ([model(health={"interval_s": 0})], {}, "models[0].health.interval_s: must be a number of seconds > 0, got 0"),
    ([model(breaker={"failure_threshold": 0})], {},
     "models[0].breaker.failure_threshold: must be an integer >= 1, got 0"),
    # urls and keys
    ([model("m", {"kind": "openai", "url": "ftp://h/v1", "context_window": 1})], {},
     ("models[0].replicas[0]: unknown key 'context_window' for an openai replica; known: api_key_env, batch_api, "
      "kind, max_in_flight, model, name, url")),
    ([model("m", {"kind": "responses", "url": "http://h/v1", "batch_api": True}, context_window=8)], {},
     "models[0].replicas[0].batch_api: a responses replica has no Batch API tokenway speaks; only openai and "
     "anthropic replicas may take a batch whole"),
    ([model("m", {"kind": "openai", "url": "http://h/v1", "batch_api": "yes"}, context_window=8)], {},
     "models[0].replicas[0].batch_api: must be true or false, got 'yes'"),
    ([model("m", {"kind": "openai", "url": "ftp://h/v1"}, context_window=8)], {},
     "models[0].replicas[0].url: must be http(s)://host[:port][/path], got 'ftp://h/v1'"),
    ([model("m", {"kind": "openai", "url": "http://h:99999/v1"}, context_window=8)], {},
     "models[0].replicas[0].url: bad port in 'http://h:99999/v1'"),
    ([model("m", {"kind": "worker", "url": "http://h:8100/worker/v1"})], {},
     ("models[0].replicas[0].url: a worker's root, e.g. http://10.0.0.11:8100 (tokenway adds /worker/v1), "
      "got 'http://h:8100/worker/v1'")),
    ([model("m", {"kind": "worker"})], {}, "models[0].replicas[0].url: required"),
    ([model("m", dict(OPENAI, api_key_env="sk-live-123"), context_window=8)], {},
     ("models[0].replicas[0].api_key_env: must name an environment variable (letters, digits, _), "
      "not hold the key itself")),
    ([model("m", OPENAI)], {},
     ("models[0].context_window: required for a model with an openai, anthropic or responses replica (tokenway "
      "cannot ask them; the window check and /v1/models need it)")),
    # names and aliases
    ([model("a"), model("a", WORKER)], {}, "models[1].name: 'a' is already the name of models[0]"),
    ([model("a", aliases=["x"]), model("b", WORKER, aliases=["y", "x"])], {},
     "models[1].aliases[1]: 'x' is already an alias of models[0]"),
    ([model("a"), model("b", WORKER, aliases=["a"])], {}, "models[1].aliases[0]: 'a' is already the name of models[0]"),
    ([model("a", aliases=["b"]), model("b", WORKER)], {}, "models[1].name: 'b' is already an alias of models[0]"),
    ([model("a", aliases=["x", "x"])], {}, "models[0].aliases[1]: 'x' is already a name of this model"),
    ([model("a", aliases=["a"])], {}, "models[0].aliases[0]: 'a' is already a name of this model"),
    ([model("gpt 4")], {}, "models[0].name: must be 1 to 256 printable characters without spaces, got 'gpt 4'"),
    ([model("a"), model("b", WORKER, aliases=[DEFAULT_EMBEDDING_MODEL])], {},
     ("models[1]: 'all-minilm-l6-v2' is the default embeddings model's name, served as the config lists no embeddings "
      "model; list it with kind = \"embeddings\", or set embeddings = false")),
    ([model("a"), model("b", WORKER, aliases=[DEFAULT_EMBEDDING_MODEL])], {"embeddings": False}, None),
    # pools
    ([model("m", replicas=[])], {}, "models[0].replicas: at least one ([[models.replicas]])"),
    ([model("m", WORKER, WORKER)], {},
     ("models[0].replicas[1].name: '10.0.0.1:8100' is already another replica's; give each replica of a pool its "
      "own name")),
    ([model("m", LOCAL, dict(LOCAL, name="again"))], {},
     ("models[0].replicas[1]: a second local replica; this process runs one engine, so it would be the same "
      "replica twice")),
    ([model("a"), model("b", WORKER, LOCAL)], {},
     ("models[1].replicas[1]: a second chat model with a local replica (models[0] has one); this process runs one "
      "chat engine for now: serve the others from tokenway workers")),
    # fallbacks
    ([model("a", fallbacks=["nope"])], {},
     "models[0].fallbacks[0]: no model is named 'nope'; known: a, all-minilm-l6-v2"),
    ([model("a", aliases=["x"], fallbacks=["x"])], {},
     "models[0].fallbacks[0]: 'x' is this model; a model cannot fall back to itself"),
    ([model("a", fallbacks=["b", "b2"]), model("b", WORKER, aliases=["b2"])], {},
     "models[0].fallbacks[1]: 'b2' is 'b', already a fallback of this model"),
    ([model("a", fallbacks=[DEFAULT_EMBEDDING_MODEL])], {},
     ("models[0].fallbacks[0]: 'all-minilm-l6-v2' is an embeddings model; a chat model falls back only to chat "
      "models")),
    ([model("a", fallbacks=["b"]), model("b", WORKER, fallbacks=["c"]), model("c", WORKER, fallbacks=["a"])], {},
     "models[0].fallbacks: a cycle, a → b → c → a; a fallback must not lead back to a model already tried"),
    ([model("a")], {"models_extra": 1, "served_model_name": None}, None),  # other top-level keys: not the registry's
]


@pytest.mark.parametrize(("models", "top", "message"), ERRORS)
def test_validation_error_names_the_key(models, top, message):
    if message is None:
        load(*models, **top)
        return
    with pytest.raises(ValueError) as exc_info:
        Registry.from_config({"models": models, **top}, default_model=DEFAULT_MODEL)
    assert str(exc_info.value) == message


def test_served_model_name_taking_the_embeddings_name_is_refused():
    with pytest.raises(ValueError, match=r"^served_model_name: 'all-minilm-l6-v2' is the default embeddings"):
        Registry.from_config({}, default_model=DEFAULT_MODEL, served_model_names=[DEFAULT_EMBEDDING_MODEL])


def test_served_model_name_with_models_is_refused():
    with pytest.raises(ValueError, match=r"^served_model_name: not used with \[\[models\]\]"):
        Registry.from_config({"models": [model()]}, default_model=DEFAULT_MODEL, served_model_names=["x"])


def test_a_key_pasted_into_a_url_is_not_echoed():
    secret = "sk-ant-api03-very-secret"
    with pytest.raises(ValueError) as exc_info:
        load(model("m", dict(OPENAI, url=f"https://user:{secret}@api.example.com/v1"), context_window=8))
    assert str(exc_info.value).startswith("models[0].replicas[0].url: must not hold credentials")
    assert secret not in str(exc_info.value)


def test_urls_are_normalised_and_dashes_accepted():
    registry = load(model("m", {"kind": "openai", "url": "https://api.example.com/v1/", "api-key-env": "KEY"},
                          **{"context-window": 8192}))
    replica = registry.resolve("m").replicas[0]
    assert (replica.url, replica.name, replica.api_key_env) == ("https://api.example.com/v1", "api.example.com", "KEY")


def test_registry_built_in_code_is_checked_too():
    a = ModelEntry("a", (ReplicaSpec("local", model="x"),), fallbacks=("b",))
    b = ModelEntry("b", (ReplicaSpec("worker", url="http://w:8100/"),), fallbacks=("a",))
    assert b.replicas[0].url == "http://w:8100"
    with pytest.raises(ValueError, match=r"^models\[0\].fallbacks: a cycle, a → b → a"):
        Registry((a, b))
