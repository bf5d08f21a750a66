"""The KV cache's blocks as `bunsan serve` hands them out (vLLM's block manager, with its prefix cache).

The pool's blocks hold `block_size` tokens' keys and values each. A sequence owns a list of blocks (its block
table) that grows as it does; when it ends its blocks go back. A block a sequence filled completely is also
kept under its content, the exact tokens from the sequence's start to the block's end, so a later prompt
that starts with the same tokens takes the block instead of computing it again (a system prompt, a chat's
earlier turns, the n answers of one prompt). Blocks in use are counted (several sequences share a prefix);
a free block that holds cached content stays findable until the pool needs it, least recently freed first.

Content is matched exactly, never by a hash that could collide: a block's key is (its parent block's
content id, its own tokens), and content ids are never reused.
"""

from __future__ import annotations

from collections import OrderedDict


class BlockPool:
    """Blocks 1..num_blocks-1 to hand out (block 0 takes the writes of padding positions, and pads tables)."""

    TRASH = 0

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 2:
            raise ValueError(f"a KV cache of {num_blocks} blocks holds nothing (block 0 takes padding writes); give "
                             "it more memory (--kv-cache-memory)")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.refs = [0] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))
        self.content: dict[int, tuple] = {}        # block -> its key in `cached`
        self.cached: dict[tuple, tuple[int, int]] = {}   # (parent content id, tokens) -> (block, content id)
        self.next_id = 1

    @property
    def usable(self) -> int:
        """Blocks sequences can hold (all but block 0)."""
        return self.num_blocks - 1

    def available(self) -> int:
        """Blocks that can be handed out now (free, cached content or not)."""
        return len(self.free)

    def allocate(self) -> int | None:
        """A free block (the least recently freed, forgetting its cached content), or None when none is free."""
        if not self.free:
            return None
        block, _ = self.free.popitem(last=False)
        key = self.content.pop(block, None)
        if key is not None:
            del self.cached[key]
        self.refs[block] = 1
        return block

    def release(self, blocks: list[int]) -> None:
        """A sequence is done with `blocks` (in table order): each goes back once no sequence holds it, its last
        blocks first in line to be reused (a shared prefix's first blocks are the likeliest to be asked again)."""
        for block in reversed(blocks):
            self.refs[block] -= 1
            if self.refs[block] == 0:
                self.free[block] = None

    def cached_prefix(self, tokens: list[int], limit: int, root: int = 0) -> tuple[list[int], int]:
        """(the blocks, their content id chain's last id) holding the longest run of whole blocks of `tokens`
        from the start, at most `limit` tokens, in the chain that starts at `root` (the model's own keys and
        values: 0, or a LoRA adapter's); each block taken (counted as held by the caller)."""
        blocks, parent, bs = [], root, self.block_size
        for start in range(0, limit - bs + 1, bs):
            found = self.cached.get((parent, tuple(tokens[start:start + bs])))
            if found is None:
                break
            block, parent = found
            blocks.append(block)
        for block in blocks:
            if self.refs[block] == 0:
                del self.free[block]
            self.refs[block] += 1
        return blocks, parent

    def register(self, block: int, parent: int, tokens: list[int]) -> int:
        """`block` now holds `tokens` (a whole block) after the content `parent` (a root: the sequence's start); its
        content id. Content already cached in another block keeps that block's id (this one stays private)."""
        key = (parent, tuple(tokens))
        if key in self.cached:
            return self.cached[key][1]
        content_id, self.next_id = self.next_id, self.next_id + 1
        self.cached[key] = (block, content_id)
        self.content[block] = key
        return content_id
