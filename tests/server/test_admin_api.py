import time

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from starlette.requests import Request
from starlette.responses import JSONResponse

from tokenway.gateway.keystore import KeyStore
from tokenway.protocol.errors import TokenwayError, openai_error_body
from tokenway.server.admin_api import admin_router

ADMIN_KEY = "admin-0123456789abcdef"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


@pytest.fixture
def store(tmp_path):
    with KeyStore(tmp_path / "tokenway.db") as store:
        yield store


def make_client(store: KeyStore, admin_key: str | None) -> TestClient:
    app = FastAPI()
    app.include_router(admin_router(store, admin_key))

    @app.exception_handler(TokenwayError)
    async def on_tokenway_error(request: Request, exc: TokenwayError) -> JSONResponse:
        return JSONResponse(openai_error_body(exc), status_code=exc.status, headers=exc.headers)

    return TestClient(app)


@pytest.fixture
def client(store):
    return make_client(store, ADMIN_KEY)


def assert_error(response, status: int, error_type: str, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == error_type
    assert error["param"] == param
    return error


def test_key_lifecycle_over_http(client, store):
    created = client.post("/admin/keys", headers=ADMIN, json={"name": "ci", "models": ["m1"], "rpm": 60,
                                                               "budget_usd": 5, "expires_at": time.time() + 60})
    assert created.status_code == 201
    body = created.json()
    secret, key_id = body["key"], body["key_id"]
    assert (body["name"], body["models"], body["rpm"], body["budget_usd"], body["tpm"]) == ("ci", ["m1"], 60, 5.0, None)
    assert body["hint"] == f"tw-{key_id}-…{secret[-4:]}"
    assert store.authenticate(secret).rpm == 60

    listed = client.get("/admin/keys", headers=ADMIN)
    assert listed.status_code == 200 and [k["key_id"] for k in listed.json()["data"]] == [key_id]
    assert secret not in listed.text and "key" not in listed.json()["data"][0]

    rotated = client.post(f"/admin/keys/{key_id}/rotate", headers=ADMIN)
    assert rotated.status_code == 200 and rotated.json()["key_id"] == key_id
    new_secret = rotated.json()["key"]
    assert store.authenticate(secret) is None and store.authenticate(new_secret) is not None

    revoked = client.post(f"/admin/keys/{key_id}/revoke", headers=ADMIN)
    assert revoked.status_code == 200 and revoked.json()["revoked_at"] is not None
    assert store.authenticate(new_secret) is None
    again = client.post(f"/admin/keys/{key_id}/revoke", headers=ADMIN)
    assert again.status_code == 200 and again.json()["revoked_at"] == revoked.json()["revoked_at"]
    assert_error(client.post(f"/admin/keys/{key_id}/rotate", headers=ADMIN), 400, "invalid_request_error")


def test_a_key_may_be_made_in_or_out_of_the_response_cache(client, store):
    for setting in (True, False, None):
        body = {"name": "cached"} | ({} if setting is None else {"response_cache": setting})
        created = client.post("/admin/keys", headers=ADMIN, json=body)
        assert created.status_code == 201 and created.json()["response_cache"] is setting
        assert store.authenticate(created.json()["key"]).response_cache is setting
    assert_error(client.post("/admin/keys", headers=ADMIN, json={"name": "x", "response_cache": "yes"}), 400,
                 "invalid_request_error", "response_cache")


@pytest.mark.parametrize("headers", [
    {},
    {"Authorization": "Bearer wrong"},
    {"Authorization": f"Bearer {ADMIN_KEY}x"},
    {"Authorization": f"Basic {ADMIN_KEY}"},
    {"x-api-key": ADMIN_KEY},
])
def test_admin_routes_need_the_admin_key(client, store, headers):
    _, info = store.create("ci")
    for method, path in (("GET", "/admin/keys"), ("POST", "/admin/keys"),
                         ("POST", f"/admin/keys/{info.key_id}/revoke"), ("POST", f"/admin/keys/{info.key_id}/rotate")):
        response = client.request(method, path, headers=headers, json={"name": "x"})
        assert assert_error(response, 401, "authentication_error")["code"] == "invalid_admin_key"
    assert [i.name for i in store.list(include_revoked=False)] == ["ci"]  # nothing changed


def test_admin_api_is_404_when_no_admin_key_is_configured(store):
    client = make_client(store, None)
    assert_error(client.get("/admin/keys", headers=ADMIN), 404, "not_found_error")
    assert_error(client.post("/admin/keys", headers={"Authorization": "Bearer "}, json={"name": "x"}),
                 404, "not_found_error")
    assert store.list() == []


def test_an_empty_admin_key_is_a_configuration_error(store):
    with pytest.raises(ValueError, match="admin_key"):
        admin_router(store, " ")


def test_unknown_key_ids_are_404(client):
    for action in ("revoke", "rotate"):
        for key_id in ("k_00000000", "%0B%C3%91L", "not-a-key-id"):  # ids of no key's shape too
            error = assert_error(client.post(f"/admin/keys/{key_id}/{action}", headers=ADMIN), 404,
                                 "not_found_error")
            assert error["code"] == "key_not_found"


@pytest.mark.parametrize("body, param, fragment", [
    ({"name": "ci", "rpm": 0}, "rpm", ">= 1"),
    ({"name": "ci", "rpm": "60"}, "rpm", "integer"),
    ({"name": "ci", "tpm": True}, "tpm", "integer"),
    ({"name": "ci", "models": []}, "models", "at least 1"),
    ({"name": ""}, "name", "at least 1"),
    ({"rpm": 5}, "name", "required"),
    ({"name": "ci", "rpm_limit": 5}, "rpm_limit", "Unrecognized"),
    ({"name": "ci", "budget_usd": -1}, "budget_usd", ">= 0"),
    ({"name": "ci", "expires_at": 1.0}, "expires_at", "future"),
])
def test_bad_create_bodies_get_openai_shaped_400s(client, store, body, param, fragment):
    error = assert_error(client.post("/admin/keys", headers=ADMIN, json=body), 400, "invalid_request_error", param)
    assert fragment in error["message"]
    assert store.list() == []


def test_malformed_json_is_a_400(client):
    response = client.post("/admin/keys", headers={**ADMIN, "content-type": "application/json"}, content=b"{nope")
    assert "not valid JSON" in assert_error(response, 400, "invalid_request_error")["message"]


def test_an_unreachable_key_store_is_a_503_with_retry_after(client, store, monkeypatch):
    from tokenway.gateway.keystore import KeyStoreUnavailable

    def unreachable(*args, **kwargs):
        raise KeyStoreUnavailable("db:5432/keys", 5.0)

    monkeypatch.setattr(store, "create", unreachable)
    monkeypatch.setattr(store, "list", unreachable)
    for response in (client.post("/admin/keys", headers=ADMIN, json={"name": "x"}),
                     client.get("/admin/keys", headers=ADMIN)):
        error = assert_error(response, 503, "service_unavailable")
        assert error["code"] == "key_store_unavailable" and response.headers["retry-after"] == "5"
