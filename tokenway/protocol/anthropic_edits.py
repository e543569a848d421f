"""The context_management field of an Anthropic Messages request (the beta's context editing,
anthropic/types/beta/beta_context_management_config_param.py): which edits to make to the
conversation before the model sees it. server/anthropic_context.py makes them."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from tokenway.protocol.openai_messages import MAX_COUNT, TaggedUnion, WireModel, fail

Count = Annotated[int, Field(ge=0, le=MAX_COUNT)]


class InputTokens(WireModel):
    type: Literal["input_tokens"]
    value: Count


class ToolUses(WireModel):
    type: Literal["tool_uses"]
    value: Count


class ClearToolUses(WireModel):
    """Older tool results (and, with clear_tool_inputs, their calls' inputs) replaced by a
    placeholder once the prompt passes the trigger (server/anthropic_context.py)."""

    type: Literal["clear_tool_uses_20250919"]
    trigger: Annotated[InputTokens | ToolUses, TaggedUnion("trigger")] = InputTokens(type="input_tokens",
                                                                                     value=100_000)
    keep: ToolUses = ToolUses(type="tool_uses", value=3)
    clear_at_least: InputTokens | None = None
    clear_tool_inputs: bool | list[str] | None = None
    exclude_tools: list[str] | None = None


class ThinkingTurns(WireModel):
    type: Literal["thinking_turns"]
    value: Count


class AllThinkingTurns(WireModel):
    type: Literal["all"]


class ClearThinking(WireModel):
    """The thinking of all but the last `keep` assistant turns that thought, left out."""

    type: Literal["clear_thinking_20251015"]
    keep: Annotated[ThinkingTurns | AllThinkingTurns, TaggedUnion("keep")] | Literal["all"] = ThinkingTurns(
        type="thinking_turns", value=1)


class Compact(WireModel):
    type: Literal["compact_20260112"]

    @model_validator(mode="after")
    def _not_here(self) -> Compact:
        raise fail("compaction", "compact_20260112 summarizes the conversation server-side mid-call, which this "
                   "server does not do; clear tool results (clear_tool_uses_20250919) or compact client-side")


class ContextManagement(WireModel):
    edits: list[Annotated[ClearToolUses | ClearThinking | Compact, TaggedUnion("edit")]] | None = None
