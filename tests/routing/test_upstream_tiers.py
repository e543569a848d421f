"""What an upstream is sent of a job's service tier: OpenAI's service_tier for flex and priority
(chat, completions, responses), Anthropic's "auto" for priority; nothing for the others."""

import pytest

from tokenway.protocol.job import GenerationJob
from tokenway.protocol.sampling import SamplingParams
from tokenway.routing.anthropic_upstream import messages_body
from tokenway.routing.openai_upstream import chat_body, completion_body
from tokenway.routing.responses_upstream import responses_body

HI = ({"role": "user", "content": "hi"},)


def job(service_class: str, kind: str = "chat") -> GenerationJob:
    return GenerationJob("r1", "m", kind, SamplingParams(max_tokens=4), messages=HI if kind == "chat" else (),
                         prompt="hi" if kind == "completion" else None, service_class=service_class)


@pytest.mark.parametrize("service_class, sent", [
    ("priority", "priority"), ("flex", "flex"), ("default", None), ("batch", None)])
def test_an_openai_upstream_is_sent_flex_and_priority(service_class, sent):
    for body in (chat_body(job(service_class), "up"), completion_body(job(service_class, "completion"), "up"),
                 responses_body(job(service_class), "up")):
        assert body.get("service_tier") == sent


@pytest.mark.parametrize("service_class, sent", [
    ("priority", "auto"), ("flex", None), ("default", None), ("batch", None)])
def test_an_anthropic_upstream_is_sent_auto_for_priority(service_class, sent):
    assert messages_body(job(service_class), "claude", 1024).get("service_tier") == sent
