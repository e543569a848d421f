"""Tools for the tool loop: Python callables whose JSON schema comes from their type hints (or
pydantic models), and raw-schema tools (an MCP server's), all validated before they run.

    @tool
    def get_weather(city: str, days: Annotated[int, Field(ge=1, le=7)] = 1) -> dict:
        '''The forecast for a city.

        Args:
            city: the city's name, e.g. "Paris"
            days: how many days ahead
        '''
    get_weather.spec()                 # the OpenAI `tools` entry
    await get_weather.invoke('{"city": "Paris"}')   # -> ToolOutcome(text, error)

Arguments are checked against the schema before the call: pydantic for callables (so
validators that no JSON schema can say, such as AfterValidator, hold too), jsonschema for raw
schemas. Extra arguments are refused (additionalProperties: false), as OpenAI's strict mode
does. Nothing raises out of invoke(): an unknown tool, arguments that are not JSON or do not
validate, a tool that raises or overruns its timeout, each becomes an error text for the
model, which can then fix its call (the loop's caps bound how often).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, get_type_hints

import jsonschema
import pydantic

ERROR_KINDS = ("unknown_tool", "invalid_json", "invalid_arguments", "raised", "timeout", "not_run")


@dataclass(frozen=True, slots=True)
class ToolOutcome:
    text: str  # what goes back to the model as the tool message's content
    error: str | None = None  # one of ERROR_KINDS, or None when the tool ran and returned


class InvalidArguments(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]  # JSON schema of the arguments object
    run: Callable[[Any], Awaitable[Any]]  # validated arguments -> result
    validate: Callable[[dict[str, Any]], Any]  # raises InvalidArguments

    def spec(self) -> dict[str, Any]:
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}

    async def invoke(self, arguments: str | dict[str, Any], timeout: float | None = None) -> ToolOutcome:
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments or "{}")
            except ValueError as exc:
                return ToolOutcome(f"Error: the arguments for {self.name} are not JSON ({exc}). "
                                   "Call it again with a JSON object.", "invalid_json")
        if not isinstance(arguments, dict):
            return ToolOutcome(f"Error: the arguments for {self.name} must be a JSON object.", "invalid_json")
        try:
            valid = self.validate(arguments)
        except InvalidArguments as exc:
            return ToolOutcome(f"Error: invalid arguments for {self.name}: {exc}. Fix them and call again.",
                               "invalid_arguments")
        try:
            async with asyncio.timeout(timeout):
                result = await self.run(valid)
        except TimeoutError:
            return ToolOutcome(f"Error: {self.name} did not finish within {timeout}s.", "timeout")
        except Exception as exc:  # the tool's own failure is the model's to read, not the loop's to raise
            return ToolOutcome(f"Error: {self.name} failed: {type(exc).__name__}: {exc}", "raised")
        return ToolOutcome(as_text(result))


def as_text(result: Any) -> str:
    if isinstance(result, str):
        return result
    if isinstance(result, pydantic.BaseModel):
        return result.model_dump_json()
    return json.dumps(pydantic.TypeAdapter(type(result)).dump_python(result, mode="json"), ensure_ascii=False)


def tool(fn: Callable[..., Any] | None = None, *, name: str | None = None,
         description: str | None = None) -> Any:
    """A Tool from a function (sync or async); usable bare (@tool) or with arguments."""
    if fn is None:
        return lambda f: function_tool(f, name=name, description=description)
    return function_tool(fn, name=name, description=description)


def function_tool(fn: Callable[..., Any], *, name: str | None = None, description: str | None = None) -> Tool:
    summary, arg_docs = parse_docstring(inspect.getdoc(fn) or "")
    # Under `from __future__ import annotations` hints are strings; a tool defined inside a
    # function may name that function's locals (a validator, a model), as pydantic allows.
    hints = get_type_hints(fn, localns=_caller_locals(), include_extras=True)
    fields: dict[str, Any] = {}
    for param in inspect.signature(fn).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        if param.name not in hints:
            raise TypeError(f"{fn.__name__}: parameter {param.name!r} needs a type hint (it makes the schema)")
        default = ... if param.default is param.empty else param.default
        fields[param.name] = (hints[param.name], pydantic.Field(default, description=arg_docs.get(param.name)))
    model = pydantic.create_model(f"{fn.__name__}_arguments", __config__=pydantic.ConfigDict(extra="forbid"),
                                  **fields)
    parameters = _without_titles(model.model_json_schema())

    def validate(arguments: dict[str, Any]) -> dict[str, Any]:
        try:
            valid = model.model_validate(arguments)
        except pydantic.ValidationError as exc:
            raise InvalidArguments(_pydantic_problems(exc)) from None
        return {key: getattr(valid, key) for key in fields}

    async def run(kwargs: dict[str, Any]) -> Any:
        if inspect.iscoroutinefunction(fn):
            return await fn(**kwargs)
        return await asyncio.to_thread(fn, **kwargs)

    return Tool(name or fn.__name__, description or summary, parameters, run, validate)


def schema_tool(name: str, description: str, parameters: dict[str, Any],
                run: Callable[[dict[str, Any]], Awaitable[Any]], closed: bool = True) -> Tool:
    """A Tool from a JSON schema and an async callable taking the arguments object. `closed`:
    an object schema that does not say whether other properties are allowed gets
    additionalProperties false, as for callables (a model given an open schema invents
    arguments, and a grammar-constrained one may write them until max_tokens)."""
    parameters = dict(parameters or {"type": "object", "properties": {}})
    if closed and parameters.get("type") == "object" and "additionalProperties" not in parameters:
        parameters["additionalProperties"] = False
    validator = jsonschema.Draft202012Validator(parameters)

    def validate(arguments: dict[str, Any]) -> dict[str, Any]:
        problems = sorted(validator.iter_errors(arguments), key=lambda e: list(e.absolute_path))
        if problems:
            raise InvalidArguments("; ".join(f"{'.'.join(map(str, p.absolute_path)) or '(arguments)'}: {p.message}"
                                             for p in problems[:5]))
        return arguments

    return Tool(name, description, _without_titles(parameters), run, validate)


def _caller_locals() -> dict[str, Any]:
    frame = inspect.currentframe()
    while frame is not None and frame.f_globals.get("__name__") == __name__:
        frame = frame.f_back
    return dict(frame.f_locals) if frame is not None else {}


def parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """(the summary paragraph, {argument: description}) of a Google-style docstring."""
    summary = doc.split("\n\n", 1)[0].strip().replace("\n", " ")
    arg_docs: dict[str, str] = {}
    section = re.search(r"^(?:Args|Arguments|Parameters):\s*\n((?:[ \t]+.*\n?|\s*\n)*)", doc, re.MULTILINE)
    if section:
        current = None
        for line in section.group(1).splitlines():
            match = re.match(r"\s+(\w+)(?:\s*\([^)]*\))?\s*:\s*(.*)", line)
            if match and (current is None or len(line) - len(line.lstrip()) <= _indent_of(section.group(1))):
                current = match.group(1)
                arg_docs[current] = match.group(2).strip()
            elif current and line.strip():
                arg_docs[current] += " " + line.strip()
    return summary, arg_docs


def _indent_of(block: str) -> int:
    first = next((line for line in block.splitlines() if line.strip()), "")
    return len(first) - len(first.lstrip())


def _pydantic_problems(exc: pydantic.ValidationError) -> str:
    problems = []
    for error in exc.errors()[:5]:
        where = ".".join(str(part) for part in error["loc"]) or "(arguments)"
        got = "" if error["type"] == "missing" else f" (got {json.dumps(error.get('input'), default=str)[:60]})"
        problems.append(f"{where}: {error['msg']}{got}")
    return "; ".join(problems)


def _without_titles(schema: Any) -> Any:
    """pydantic's generated titles ("City", "Get Weather Arguments") are noise in a prompt."""
    if isinstance(schema, dict):
        return {key: _without_titles(value) for key, value in schema.items()
                if not (key == "title" and isinstance(value, str))}
    if isinstance(schema, list):
        return [_without_titles(item) for item in schema]
    return schema
