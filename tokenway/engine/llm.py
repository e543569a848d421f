"""The offline API, in vLLM's shape:

    from tokenway import LLM, SamplingParams
    llm = LLM(model="smollm2-135m-instruct")
    outputs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tokenway.config import EngineConfig
from tokenway.engine.core import EngineCore
from tokenway.frontend.output import RequestOutput, RequestState
from tokenway.models.loader import DEFAULT_MODEL
from tokenway.protocol.job import SERVICE_CLASSES, ServiceClass
from tokenway.protocol.sampling import SamplingParams, choice_params

if TYPE_CHECKING:
    from typing_extensions import TypeIs  # typing's own from Python 3.13

PromptLike = str | dict[str, Any]


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, **engine_options: Any) -> None:
        self.engine = EngineCore(EngineConfig(model=model, **engine_options))
        self.tokenizer = self.engine.tokenizer
        self._request_counter = itertools.count()

    def generate(
        self,
        prompts: PromptLike | Sequence[PromptLike],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        service_class: ServiceClass | Sequence[ServiceClass] = "default",
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. A prompt is a string or
        {"prompt_token_ids": [...]}; every prompt is checked before any runs. service_class: one
        for every prompt, or one per prompt (engine/scheduler.py serves the best first)."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params_list = self._params_list(sampling_params, len(prompts))
        classes = _classes_list(service_class, len(prompts))
        encoded = []
        for prompt, params, prompt_class in zip(prompts, params_list, classes):
            if isinstance(prompt, str):
                token_ids = self.tokenizer.encode(prompt)
                text = prompt
            elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
                token_ids, text = [int(t) for t in prompt["prompt_token_ids"]], None
            else:
                raise ValueError("prompt: expected a string or {'prompt_token_ids': [...]}, "
                                 f"got {type(prompt).__name__}")
            self.engine.validate_prompt(token_ids, params)
            encoded.append((text, token_ids, params, prompt_class))
        return self._run(encoded)

    def chat(
        self,
        conversations: list[dict] | Sequence[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        batch = [conversations] if _is_one_conversation(conversations) else conversations
        prompts = [
            {
                "prompt_token_ids": self.tokenizer.encode(
                    self.tokenizer.apply_chat_template(
                        list(c), add_generation_prompt=add_generation_prompt, tools=tools),
                    add_special_tokens=False,
                )
            }
            for c in batch
        ]
        return self.generate(prompts, sampling_params)

    @staticmethod
    def _params_list(sampling_params, count: int) -> list[SamplingParams]:
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * count
        if len(sampling_params) != count:
            raise ValueError(f"sampling_params: got {len(sampling_params)} for {count} prompts")
        return list(sampling_params)

    def _run(self, encoded: list[tuple[str | None, list[int], SamplingParams, ServiceClass]]) -> list[RequestOutput]:
        # n > 1 fans out into n engine requests that share the prompt (and so its cached blocks).
        states: dict[str, RequestState] = {}
        request_id_to_class: dict[str, ServiceClass] = {}
        parents: list[list[str]] = []
        for text, token_ids, params, service_class in encoded:
            parent_id = str(next(self._request_counter))
            child_ids = []
            for index, child_params in enumerate(choice_params(params, params.n)):
                request_id = parent_id if params.n == 1 else f"{parent_id}-{index}"
                states[request_id] = RequestState(request_id, text, token_ids, child_params, self.tokenizer, index)
                request_id_to_class[request_id] = service_class
                child_ids.append(request_id)
            parents.append(child_ids)
        try:
            for request_id, state in states.items():
                self.engine.add_request(request_id, state.prompt_token_ids, state.params,
                                        request_id_to_class[request_id])
            finals: dict[str, RequestOutput] = {}
            while self.engine.has_unfinished_requests():
                for engine_output in self.engine.step():
                    state = states[engine_output.request_id]
                    if state.finished:
                        continue
                    result = state.process(engine_output)
                    if result.finished:
                        finals[engine_output.request_id] = result
                        if not engine_output.finished:  # a stop string matched
                            self.engine.finish_request(engine_output.request_id, result.outputs[0].stop_reason)
        except BaseException:
            self.engine.abort_requests(list(states))
            raise
        results = []
        for child_ids in parents:
            first = finals[child_ids[0]]
            first.outputs = [finals[c].outputs[0] for c in child_ids]
            first.request_id = child_ids[0].split("-")[0]
            results.append(first)
        return results


def _classes_list(service_class: ServiceClass | Sequence[ServiceClass], count: int) -> list[ServiceClass]:
    classes: list[ServiceClass]
    if isinstance(service_class, str):
        classes = [service_class] * count
    elif len(service_class) != count:
        raise ValueError(f"service_class: got {len(service_class)} for {count} prompts")
    else:
        classes = list(service_class)
    for entry in classes:
        if entry not in SERVICE_CLASSES:
            raise ValueError(f"service_class: expected one of {', '.join(SERVICE_CLASSES)}, got {entry!r}")
    return classes


def _is_one_conversation(conversations: list[dict] | Sequence[list[dict]]) -> TypeIs[list[dict]]:
    """A conversation's messages, rather than a batch of conversations."""
    return bool(conversations) and isinstance(conversations[0], dict)
