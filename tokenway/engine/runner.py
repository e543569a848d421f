"""ModelRunner: owns the model and the KV tensors; turns a SchedulerOutput into logits.

The scheduler decides what runs; the runner only lays it out. It loops over the
scheduled requests once to build the flat batch [decode tokens | prefill tokens],
the cache slots each new token writes, and the attention layout.

Each KV cache group (kv_cache/manager.py) has its own block ids, and so its own KV tensors, slots
and layout: the model's full-attention layers read `meta`, its sliding-window layers `meta.sliding`
(the same layout with a window where every layer slides). Where layers mix, the sliding layers'
tensors hold num_sliding_blocks blocks, and their tables are the SchedulerOutput's
sliding_block_tables.
"""

from __future__ import annotations

import torch

from tokenway.engine.scheduler import SchedulerOutput
from tokenway.models.attention import AttentionMetadata, BlockRun, PrefillChunk, SharedPrefix, native_decode_kernel
from tokenway.models.config import ModelConfig
from tokenway.models.decoder import DecoderForCausalLM
from tokenway.models.interjection import Interjection

# Decode rows sharing fewer cached blocks than this read them on their own: the split costs
# more than the copies it saves.
MIN_SHARED_BLOCKS = 2


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V for every layer of one block."""
    element_size = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * block_size * config.num_key_value_heads * config.head_dim * element_size


class ModelRunner:
    def __init__(self, model: DecoderForCausalLM, num_blocks: int, block_size: int, device: torch.device,
                 cascade_attention: bool = True, native_attention: bool = True, native_layers: bool = True,
                 num_sliding_blocks: int | None = None) -> None:
        """num_blocks: the blocks of every layer's KV tensors, or of the full-attention layers' where
        layers mix; then num_sliding_blocks (None: num_blocks) those of the sliding-window layers."""
        config = model.config
        self.model = model
        self.cascade_attention = cascade_attention  # read prefixes shared by decode rows once per step
        # The C++ paged decode kernel reads every row's blocks in place (None: the torch path).
        self.decode_kernel = native_decode_kernel(model.dtype, config.head_dim, device) if native_attention else None
        self.block_size = block_size
        self.device = device
        self.sliding_window = config.sliding_window if config.layer_types else None
        self.full_layers = config.uniform_window is None
        # The sliding layers read tables of their own (SchedulerOutput.sliding_block_tables).
        self.mixed_layers = self.full_layers and self.sliding_window is not None
        if num_sliding_blocks is None or not self.mixed_layers:
            num_sliding_blocks = num_blocks

        # Per layer: (its group's num_blocks * block_size, kv_heads, head_dim); slot = block_id * block_size + offset.
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        for layer in range(config.num_hidden_layers):
            layer_blocks = num_sliding_blocks if config.is_sliding(layer) else num_blocks
            shape = (layer_blocks * block_size, config.num_key_value_heads, config.head_dim)
            self.kv_caches.append((torch.zeros(shape, dtype=model.dtype, device=device),
                                   torch.zeros(shape, dtype=model.dtype, device=device)))
        # Decode-only steps' layers in one native call, where the model's layers allow it.
        self.native_layers = native_layers and self.decode_kernel is not None and model.use_decode_stack(
            self.kv_caches, block_size)

    @property
    def kv_cache_bytes(self) -> int:
        """The memory of every layer's K and V tensors."""
        return sum(k_cache.nbytes + v_cache.nbytes for k_cache, v_cache in self.kv_caches)

    def _slots(self, block_ids: list[int], start: int, end: int) -> list[int]:
        bs = self.block_size
        return [block_ids[p // bs] * bs + p % bs for p in range(start, end)]

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, interjection: Interjection | None = None) -> torch.Tensor:
        """Run one step; returns (num_sampling_rows, vocab) float32 logits, in the order of
        out.requests restricted to those whose last scheduled token is their last known token
        or draft (a prompt chunk that does not reach the end samples nothing): one row per
        such request, and one more per draft it verifies (its k + 1 positions, in order).
        interjection: work let run between two of the step's layers (models/interjection.py)."""
        decode_rows: list[int] = []
        prefill_rows: list[int] = []
        for row, num_new in enumerate(out.num_scheduled_tokens):
            # A decode with drafts (a verify chunk) decodes each of its tokens as a row of its own
            # whose context ends at that token: causal over the drafts, on the decode kernels.
            (decode_rows if num_new == 1 + len(out.spec_token_ids[row]) else prefill_rows).append(row)

        # Per KV cache group: the first one's tables, then the sliding layers' where they have their own.
        group_tables = [out.block_tables]
        if self.mixed_layers and out.sliding_block_tables:
            group_tables.append(out.sliding_block_tables)
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mappings: list[list[int]] = [[] for _ in group_tables]
        last_token_index = [0] * len(out.requests)
        decode_tables: list[list[list[int]]] = [[] for _ in group_tables]  # per group, per decode token
        decode_context_lens: list[int] = []
        # Prompt chunks, per group: (token_start, start, end, block ids).
        chunks: list[list[tuple[int, int, int, list[int]]]] = [[] for _ in group_tables]
        for row in decode_rows + prefill_rows:
            request = out.requests[row]
            num_new = out.num_scheduled_tokens[row]
            start = request.num_computed_tokens
            end = start + num_new
            token_start = len(input_ids)
            input_ids.extend(request.all_token_ids[start:end])
            input_ids.extend(out.spec_token_ids[row])  # a verify chunk's drafts follow its last known token
            positions.extend(range(start, end))
            last_token_index[row] = token_start + num_new - 1
            is_decode = num_new == 1 + len(out.spec_token_ids[row])
            if is_decode:
                decode_context_lens.extend(range(start + 1, end + 1))
            for group, tables in enumerate(group_tables):
                block_ids = tables[row]
                slot_mappings[group].extend(self._slots(block_ids, start, end))
                if is_decode:
                    decode_tables[group].extend([block_ids] * num_new)
                else:
                    chunks[group].append((token_start, start, end, block_ids))

        def layout(group: int, window: int | None) -> AttentionMetadata:
            slots = torch.tensor(slot_mappings[group], device=self.device)
            return self._metadata(slots, decode_tables[group], decode_context_lens, chunks[group], window)

        if not self.full_layers:  # every layer slides (and blocks behind the window may be given back: never read them)
            meta = layout(0, self.sliding_window)
            meta.sliding = meta
        else:
            meta = layout(0, None)
            if self.sliding_window is not None:  # the layers that slide read their own layout
                meta.sliding = layout(len(group_tables) - 1, self.sliding_window)

        hidden = self.model(
            torch.tensor(input_ids, device=self.device),
            torch.tensor(positions, device=self.device),
            self.kv_caches,
            meta,
            interjection,
        )
        sample_index = [
            index
            for row, (request, drafts) in enumerate(zip(out.requests, out.spec_token_ids))
            if request.num_computed_tokens + out.num_scheduled_tokens[row] == request.num_tokens + len(drafts)
            for index in range(last_token_index[row] - len(drafts), last_token_index[row] + 1)
        ]
        if not sample_index:
            return torch.empty(0, self.model.config.vocab_size)
        if sample_index != list(range(hidden.shape[0])):  # else a decode-only step: every row samples, in order
            hidden = hidden.index_select(0, torch.tensor(sample_index, device=self.device))
        return self.model.compute_logits(hidden).cpu()

    def _metadata(self, slots: torch.Tensor, decode_tables: list[list[int]], decode_context_lens: list[int],
                  chunks: list[tuple[int, int, int, list[int]]], window: int | None) -> AttentionMetadata:
        """The attention layout of one step, for layers that see the whole context (window None)
        or the last `window` keys of it."""
        meta = AttentionMetadata(slot_mapping=slots, block_size=self.block_size, num_decode_tokens=len(decode_tables),
                                 prefills=[self._prefill_chunk(*chunk, window) for chunk in chunks], window=window)
        if decode_tables:
            self._decode_layout(meta, decode_tables, decode_context_lens)
        return meta

    def _prefill_chunk(self, token_start: int, start: int, end: int, block_ids: list[int],
                       window: int | None) -> PrefillChunk:
        num_new = end - start
        if start == 0 and (window is None or num_new <= window):
            return PrefillChunk(token_start, num_new, end, None, None)  # the chunk is its whole context: causal
        # A later chunk (or the tail after a prefix-cache hit) attends to its cached context too; under a
        # window, only to the blocks that hold keys some query of the chunk can see.
        bs = self.block_size
        first_block = 0 if window is None else max(0, start - window + 1) // bs
        key_start = first_block * bs
        query_pos = torch.arange(start, end, device=self.device).unsqueeze(1)
        key_pos = torch.arange(key_start, end, device=self.device).unsqueeze(0)
        mask = key_pos <= query_pos
        if window is not None:
            mask &= key_pos > query_pos - window
        if start == 0:  # a whole prompt longer than the window: its own fresh keys, masked
            return PrefillChunk(token_start, num_new, end, None, mask)
        context = BlockRun.of(block_ids[first_block: (end + bs - 1) // bs], self.device)
        return PrefillChunk(token_start, num_new, end - key_start, context, mask)

    def _shared_prefixes(self, tables: list[list[int]], context_lens: list[int],
                         window: int | None) -> list[tuple[list[int], int]]:
        """Decode rows whose contexts start with the same cached blocks (a system prompt the prefix
        cache handed to all of them): (rows, number of shared blocks) per group. Both attention
        paths read such a prefix once per step for the whole group (cascade attention). Under a
        window only rows that still see their first key share: the others read none of it, and
        their tables may start with the null block that stands for blocks given back."""
        if not self.cascade_attention or len(tables) < 2:
            return []
        by_first_block: dict[int, list[int]] = {}
        for row, table in enumerate(tables):
            if window is None or context_lens[row] <= window:
                by_first_block.setdefault(table[0], []).append(row)
        groups = []
        for rows in by_first_block.values():
            # The rows of one verify chunk (one table object) share everything yet never form a
            # group alone: reading the prefix apart rounds differently from the request's plain
            # decode row, and greedy speculation must give exactly plain decoding's tokens.
            if len({id(tables[row]) for row in rows}) < 2:
                continue
            first = tables[rows[0]]
            # Full blocks before each row's newest token only: every row keeps a block of its own.
            limit = min((context_lens[row] - 1) // self.block_size for row in rows)
            length = 0
            while length < limit and all(tables[row][length] == first[length] for row in rows):
                length += 1
            if length >= MIN_SHARED_BLOCKS:
                groups.append((rows, length))
        return groups

    def _decode_layout(self, meta: AttentionMetadata, tables: list[list[int]], context_lens: list[int]) -> None:
        """Which blocks each decode row reads. The native kernel takes every row's block table as
        it is, plus which rows lead a shared prefix; the torch path reads a shared prefix once for
        its group, then each row's own blocks, padded into one table."""
        bs = self.block_size
        window = meta.window
        if self.decode_kernel is not None:
            # The kernel skips keys outside the window itself (and keeps rows past it out of a shared prefix).
            shared = self._shared_prefixes(tables, context_lens, window)
            max_blocks = max(len(table) for table in tables)
            meta.decode_kernel = self.decode_kernel
            meta.decode_block_tables = torch.tensor([table + [0] * (max_blocks - len(table)) for table in tables],
                                                    dtype=torch.int32)
            meta.decode_context_lens = torch.tensor(context_lens, dtype=torch.int32)
            if shared:
                leaders, lengths = list(range(len(tables))), [0] * len(tables)
                for rows, length in shared:
                    for row in rows:
                        leaders[row], lengths[row] = rows[0], length * bs
                meta.decode_prefix_leaders = torch.tensor(leaders, dtype=torch.int32)
                meta.decode_prefix_lens = torch.tensor(lengths, dtype=torch.int32)
            return
        # Per row: leading blocks not read as its own (through a shared prefix, or before its window).
        num_skipped = [0] * len(tables)
        if window is None:
            for rows, length in self._shared_prefixes(tables, context_lens, window):
                meta.shared_prefixes.append(SharedPrefix(torch.tensor(rows, device=self.device),
                                                         BlockRun.of(tables[rows[0]][:length], self.device)))
                for row in rows:
                    num_skipped[row] = length
        else:
            num_skipped = [max(0, context_len - window) // bs for context_len in context_lens]
        own_tables = [table[skip: (context_len + bs - 1) // bs]
                      for table, skip, context_len in zip(tables, num_skipped, context_lens)]
        own_lens = [context_len - skip * bs for context_len, skip in zip(context_lens, num_skipped)]
        # The first key each row sees in its own blocks: past the window's start, or 0.
        first_keys = [0 if window is None else max(0, length - window) for length in own_lens]
        if len(own_tables) == 1 and first_keys[0] == 0:
            run = BlockRun.of(own_tables[0], self.device)
            if run.first_block is not None:
                meta.decode_context, meta.decode_context_len = run, own_lens[0]
                return
        max_blocks = max(len(table) for table in own_tables)
        # Padding points at block 0 and is masked out.
        meta.decode_block_table = torch.tensor([table + [0] * (max_blocks - len(table)) for table in own_tables],
                                               device=self.device)
        key_pos = torch.arange(max_blocks * bs, device=self.device).unsqueeze(0)
        valid = key_pos < torch.tensor(own_lens, device=self.device).unsqueeze(1)
        if window is not None:
            valid &= key_pos >= torch.tensor(first_keys, device=self.device).unsqueeze(1)
        meta.decode_mask = valid.view(len(tables), 1, 1, max_blocks * bs)
