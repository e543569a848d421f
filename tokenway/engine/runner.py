"""ModelRunner: owns the model and the KV tensors; turns a SchedulerOutput into logits.

The scheduler decides what runs; the runner only lays it out. It loops over the
scheduled requests once to build the flat batch [decode tokens | prefill tokens],
the cache slots each new token writes, and the attention layout.
"""

from __future__ import annotations

import torch

from tokenway.engine.scheduler import SchedulerOutput
from tokenway.models.config import ModelConfig
from tokenway.models.llama import AttentionMetadata, LlamaForCausalLM, PrefillChunk


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V for every layer of one block."""
    element_size = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * block_size * config.num_key_value_heads * config.head_dim * element_size


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int, device: torch.device) -> None:
        config = model.config
        self.model = model
        self.block_size = block_size
        self.device = device
        num_slots = num_blocks * block_size
        shape = (num_slots, config.num_key_value_heads, config.head_dim)
        # Per layer: (num_blocks * block_size, kv_heads, head_dim); slot = block_id * block_size + offset.
        self.kv_caches = [
            (torch.zeros(shape, dtype=model.dtype, device=device), torch.zeros(shape, dtype=model.dtype, device=device))
            for _ in range(config.num_hidden_layers)
        ]

    def _slots(self, block_ids: list[int], start: int, end: int) -> list[int]:
        bs = self.block_size
        return [block_ids[p // bs] * bs + p % bs for p in range(start, end)]

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> torch.Tensor:
        """Run one step; returns (num_sampling_requests, vocab) float32 logits, in the
        order of out.requests restricted to those whose last scheduled token is their last
        known token (a prompt chunk that does not reach the end samples nothing)."""
        bs = self.block_size
        decode_rows: list[int] = []
        prefill_rows: list[int] = []
        for row, num_new in enumerate(out.num_scheduled_tokens):
            (decode_rows if num_new == 1 else prefill_rows).append(row)

        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        last_token_index = [0] * len(out.requests)
        decode_context_lens: list[int] = []
        prefills: list[PrefillChunk] = []
        for row in decode_rows + prefill_rows:
            request = out.requests[row]
            num_new = out.num_scheduled_tokens[row]
            start = request.num_computed_tokens
            end = start + num_new
            block_ids = out.block_tables[row]
            token_start = len(input_ids)
            input_ids.extend(request.all_token_ids[start:end])
            positions.extend(range(start, end))
            slot_mapping.extend(self._slots(block_ids, start, end))
            last_token_index[row] = token_start + num_new - 1
            if num_new == 1:
                decode_context_lens.append(end)
            elif start == 0:
                prefills.append(PrefillChunk(token_start, num_new, end, None, None))
            else:
                # A later chunk (or the tail after a prefix-cache hit) attends to the whole context.
                context_block_ids = torch.tensor(block_ids[: (end + bs - 1) // bs], device=self.device)
                query_pos = torch.arange(start, end, device=self.device).unsqueeze(1)
                key_pos = torch.arange(end, device=self.device).unsqueeze(0)
                prefills.append(PrefillChunk(token_start, num_new, end, context_block_ids, key_pos <= query_pos))

        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slot_mapping, device=self.device),
            block_size=bs,
            num_decode_tokens=len(decode_rows),
            prefills=prefills,
        )
        if decode_rows:
            max_len = max(decode_context_lens)
            max_blocks = (max_len + bs - 1) // bs
            # Padding points at block 0 and is masked out.
            table = [out.block_tables[row][:max_blocks] for row in decode_rows]
            table = [block_ids + [0] * (max_blocks - len(block_ids)) for block_ids in table]
            meta.decode_block_table = torch.tensor(table, device=self.device)
            context_lens = torch.tensor(decode_context_lens, device=self.device)
            key_pos = torch.arange(max_blocks * bs, device=self.device).unsqueeze(0)
            meta.decode_mask = (key_pos < context_lens.unsqueeze(1)).view(len(decode_rows), 1, 1, max_blocks * bs)

        hidden = self.model(
            torch.tensor(input_ids, device=self.device),
            torch.tensor(positions, device=self.device),
            self.kv_caches,
            meta,
        )
        sample_index = [
            last_token_index[row]
            for row, request in enumerate(out.requests)
            if request.num_computed_tokens + out.num_scheduled_tokens[row] == request.num_tokens
        ]
        if not sample_index:
            return torch.empty(0, self.model.config.vocab_size)
        return self.model.compute_logits(hidden[torch.tensor(sample_index, device=self.device)]).cpu()
