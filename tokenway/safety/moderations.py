"""POST /v1/moderations in OpenAI's shape, answered by the server's configured checks.

    {"input": "text" | ["text", ...] | [{"type": "text", "text": ...}, ...], "model": optional}
      -> {"id": "modr-...", "model": "tokenway-detectors", "results": [one per text]}

Each result names every category the checks cover (the built-in detectors': api_key,
credit_card, iban, email, phone, or the configured subset), flagged where a finding scores
at least the policy's threshold; category_scores is the highest score found. Each text is read
as the input screen reads a request (normalize.py), so the two agree on what they find. Categories the
checks do not cover (OpenAI's hate, violence, ...) are not reported as false: they are absent.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Literal

from pydantic import AfterValidator, Field

from tokenway.protocol.openai_messages import RequestModel, fail
from tokenway.safety.detectors import CATEGORIES
from tokenway.safety.normalize import normalize
from tokenway.safety.screen import SafetyPolicy

MODEL = "tokenway-detectors"
MAX_INPUTS = 256


def _non_empty(text: str) -> str:
    if not text:
        raise fail("empty_input", "must not be an empty string")
    return text


class TextPart(RequestModel):
    type: Literal["text"]
    text: Annotated[str, AfterValidator(_non_empty)]


class ModerationRequest(RequestModel):
    input: Annotated[str, AfterValidator(_non_empty)] | Annotated[
        list[Annotated[str, AfterValidator(_non_empty)]], Field(min_length=1, max_length=MAX_INPUTS)] | Annotated[
        list[TextPart], Field(min_length=1, max_length=MAX_INPUTS)]
    model: str | None = None

    def texts(self) -> list[str]:
        if isinstance(self.input, str):
            return [self.input]
        return [item if isinstance(item, str) else item.text for item in self.input]


def moderation_response(policy: SafetyPolicy, texts: list[str]) -> dict:
    categories = [c for c in CATEGORIES if policy.categories is None or c in policy.categories]
    results = []
    for text in texts:
        scores = dict.fromkeys(categories, 0.0)
        for finding in policy.findings(normalize(text).text):  # the input screen's view
            scores[finding.category] = max(scores[finding.category], finding.score)
        flags = {category: score > 0.0 for category, score in scores.items()}
        results.append({"flagged": any(flags.values()), "categories": flags, "category_scores": scores,
                        "category_applied_input_types": {category: ["text"] for category in categories}})
    return {"id": f"modr-{uuid.uuid4().hex}", "model": MODEL, "results": results}
