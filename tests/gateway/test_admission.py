"""max_tokens within the window and the key's cap (gateway/admission.py), before a job is made."""

from __future__ import annotations

import pytest

from tokenway.billing.ledger import Ledger
from tokenway.billing.pricing import PriceTable
from tokenway.gateway.admission import cap_max_tokens
from tokenway.gateway.auth import ANONYMOUS, Principal
from tokenway.gateway.gatekeeper import Defaults, Gatekeeper
from tokenway.gateway.keystore import KeyStore
from tokenway.gateway.limits import InProcessLimiter
from tokenway.protocol.errors import ContextLengthExceededError, InvalidRequestError

CAPPED = Principal(key_id="k_capped", name="capped", max_tokens=100)


@pytest.fixture()
def gatekeeper(tmp_path):
    return Gatekeeper(KeyStore(tmp_path / "keys.db"), InProcessLimiter(), Ledger(f"sqlite:///{tmp_path / 'l.db'}"),
                      PriceTable.from_config({}), Defaults(max_messages=3), host="127.0.0.1")


def test_without_a_gatekeeper_the_window_alone_decides():
    assert cap_max_tokens(None, ANONYMOUS, 1000, 600, None, "max_tokens") == 400  # the rest of the window
    assert cap_max_tokens(None, ANONYMOUS, 1000, 600, 400, "max_tokens") == 400
    with pytest.raises(ContextLengthExceededError) as over:
        cap_max_tokens(None, ANONYMOUS, 1000, 600, 401, "max_completion_tokens")
    assert over.value.param == "max_completion_tokens"
    with pytest.raises(ContextLengthExceededError) as full:
        cap_max_tokens(None, ANONYMOUS, 1000, 1000, None, "max_tokens")
    assert full.value.param == "messages"


def test_a_keys_cap_fills_in_and_refuses_more(gatekeeper):
    assert cap_max_tokens(gatekeeper, CAPPED, 1000, 10, None, "max_tokens") == 100
    assert cap_max_tokens(gatekeeper, CAPPED, 1000, 950, None, "max_tokens") == 50  # the window is smaller
    with pytest.raises(ContextLengthExceededError) as full:  # the prompt alone: no completion to name
        cap_max_tokens(gatekeeper, CAPPED, 1000, 1066, None, "max_tokens")
    assert full.value.param == "messages" and full.value.max_tokens is None
    assert "your messages resulted in 1066 tokens" in full.value.message, full.value.message
    with pytest.raises(InvalidRequestError) as over:
        cap_max_tokens(gatekeeper, CAPPED, 1000, 10, 101, "max_tokens")
    assert over.value.param == "max_tokens" and "cap of 100" in over.value.message
    with pytest.raises(InvalidRequestError) as too_many:
        cap_max_tokens(gatekeeper, ANONYMOUS, 1000, 10, None, "max_tokens", num_messages=4)
    assert too_many.value.param == "messages"


def test_an_estimated_prompt_fails_only_a_max_tokens_over_the_whole_window(gatekeeper):
    # Untemplated: the upstream counts the prompt; only what cannot fit any prompt is refused here.
    assert cap_max_tokens(None, ANONYMOUS, 1000, 990, 500, "max_tokens", exact=False) == 500
    assert cap_max_tokens(None, ANONYMOUS, 1000, 990, None, "max_tokens", exact=False) is None
    assert cap_max_tokens(gatekeeper, CAPPED, 1000, 990, None, "max_tokens", exact=False) == 100
    with pytest.raises(InvalidRequestError) as whole:
        cap_max_tokens(None, ANONYMOUS, 1000, 10, 1000, "max_tokens", exact=False)
    assert whole.value.code == "context_length_exceeded"
