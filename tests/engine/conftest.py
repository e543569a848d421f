"""Helpers for the engine tests that drive an EngineClient (AsyncEngine, ProcessEngine)."""

from __future__ import annotations


def prompt_ids(engine, text: str) -> list[int]:
    return engine.tokenizer.encode(text, add_special_tokens=False)


async def collect(engine, prompt, params, request_id=None, final_only=False):
    """(each output's delta_text, the last output) of one generate call."""
    deltas, last = [], None
    async for output in engine.generate(prompt, params, request_id, final_only=final_only):
        deltas.append(output.outputs[0].delta_text)
        last = output
    return deltas, last


def assert_sent_whole(deltas, last, reference) -> None:
    """A final_only call's one output: finished, the whole reply as its delta."""
    completion = last.outputs[0]
    assert last.finished and deltas == [completion.text]
    assert completion.delta_token_ids == completion.token_ids == reference.token_ids
    assert completion.text == reference.text
