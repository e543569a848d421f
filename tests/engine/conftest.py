"""Helpers for the engine tests that drive an EngineClient (AsyncEngine, ProcessEngine)."""

from __future__ import annotations


def prompt_ids(engine, text: str) -> list[int]:
    return engine.tokenizer.encode(text, add_special_tokens=False)


async def collect(engine, prompt, params, request_id=None):
    """(each output's delta_text, the last output) of one generate call."""
    deltas, last = [], None
    async for output in engine.generate(prompt, params, request_id):
        deltas.append(output.outputs[0].delta_text)
        last = output
    return deltas, last
