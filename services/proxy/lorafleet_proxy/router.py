"""KV-prefix affinity: send a request to the replica whose prefix cache already holds its prompt.

Prompts are cut into blocks of the replicas' KV block size and their hashes chained (over at most
`max_route_blocks` leading blocks), one table per adapter; each block remembers which replicas were sent it. A block
is *common* (ignored) once it is a branch point whose branches went to different replicas; the replica holding most
of the prompt-specific blocks wins unless it is too far ahead in load. Cost per request and memory (`max_blocks`, two
generations of plain dicts per adapter) are bounded. Prompts routing cannot read raise `BadPrompt` (a 400 before
anything is sent). The rules and why: docs/concepts/architecture.md ("Routing by KV-prefix affinity").
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import orjson

Mode = Literal["affinity", "least_loaded", "round_robin"]
Outcome = Literal["affinity", "spilled", "unmatched"]

BYTES_PER_TOKEN = 4  # text/chat prompts: bytes per routing block = block_size * this (~4 bytes per token)
MAX_REPLICAS = 255  # the successor-replica field of an entry is 8 bits
MAX_COMMON_BLOCKS = 4096  # branch points remembered across adapter versions (templates, system prompts)

# Entry layout (one Python int): bit 0 = branched; bits 1-8 = first successor's replica slot + 1;
# bits 9-32 = first successor's tag (24 bits of its hash); bits 33.. = owner bitmask by replica slot.
_BRANCHED = 1
_SUCC_SLOT_SHIFT = 1
_SUCC_TAG_SHIFT = 9
_OWNER_SHIFT = 33
_SUCC_SLOT_MASK = 0xFF << _SUCC_SLOT_SHIFT
_SUCC_TAG_MASK = 0xFFFFFF << _SUCC_TAG_SHIFT
_TAG_MASK = 0xFFFFFF


@dataclass(frozen=True, slots=True)
class Prompt:
    keys: list[int]  # chained block hashes: the keys of the adapter's routing table


class BadPrompt(ValueError):
    """A prompt field routing cannot read: the request is a 400 (vLLM's validation-error shape)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class _Table:
    """One adapter's blocks (hash -> entry) in two generations."""

    __slots__ = ("old", "young")

    def __init__(self) -> None:
        self.young: dict[int, int] = {}
        self.old: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self.young) + len(self.old)


@dataclass(frozen=True)
class Decision:
    replica: str
    outcome: Outcome
    specific_blocks: int


_SEEDS = {kind: hash(b"lorafleet-route\0" + kind) for kind in (b"tokens", b"text", b"chat")}


def _chain(kind: bytes, data: bytes, size: int) -> Prompt:
    """One hash chain over the whole `size`-byte blocks of `data` (already cut to the routed head).

    Python's own 64-bit hash (SipHash for bytes): the table lives in this process only, so a per-process
    seed is fine, and it is several times cheaper than a cryptographic hash on the hot path.
    """
    keys, previous = [], _SEEDS[kind]
    for start in range(0, len(data) - size + 1, size):
        previous = hash((previous, data[start : start + size]))
        keys.append(previous)
    return Prompt(keys)


def _token_bytes(tokens: list[Any], limit: int, param: str) -> bytes:
    """The packed head of a token-id prompt; every id must be an int in [0, 2^63) (vLLM's vocabulary ids)."""
    try:
        packed = array("q", tokens)
    except (TypeError, OverflowError) as exc:
        raise BadPrompt(f"token ids must be integers in [0, 2^63): {exc}", param) from None
    if packed and min(packed) < 0:
        raise BadPrompt("token ids must be integers in [0, 2^63): got a negative id", param)
    return packed[: limit // 8].tobytes()


def _text_bytes(text: str, limit: int, param: str) -> bytes:
    try:
        return text[:limit].encode()[:limit]  # `limit` characters are at least `limit` bytes
    except UnicodeEncodeError as exc:
        raise BadPrompt(f"the prompt is not valid Unicode: {exc}", param) from None


def _canonical_messages(messages: list[Any], limit: int) -> bytes:
    """One canonical JSON line per message: a conversation's rendering is a prefix of its continuation's."""
    parts, size = [], 0
    for message in messages:
        if not isinstance(message, dict):
            raise BadPrompt("each message must be a JSON object", "body.messages")
        try:
            line = orjson.dumps(message, option=orjson.OPT_SORT_KEYS) + b"\n"
        except TypeError as exc:  # a lone surrogate or an out-of-range integer in a message
            raise BadPrompt(f"a message cannot be read: {exc}", "body.messages") from None
        parts.append(line)
        size += len(line)
        if size >= limit:
            break
    return b"".join(parts)[:limit]


class Router:
    """Chooses a replica for each request and remembers which replica was sent which prompt blocks."""

    def __init__(self, mode: Mode = "affinity", imbalance: int = 8, max_blocks: int = 200_000,
                 block_size: int = 16, max_route_blocks: int = 64) -> None:
        self.mode = mode
        self.imbalance = imbalance
        self.max_blocks = max_blocks
        self.block_size = block_size
        self.max_route_blocks = max_route_blocks
        self.counters = {"routed": 0, "affinity": 0, "spilled": 0, "unmatched": 0}
        self._tables: OrderedDict[str, _Table] = OrderedDict()  # least recently used adapter first
        self._count = 0
        self._slots: dict[str, int] = {}
        self._common: OrderedDict[int, None] = OrderedDict()  # hashes of common blocks, any adapter (LRU)
        self._rr = 0

    # --- prompt -> block hashes ------------------------------------------------------------------
    def prompt_blocks(self, body: Mapping[str, Any]) -> list[Prompt]:
        """Chained hashes of the leading blocks of each prompt in a completions or chat body; raises BadPrompt."""
        messages = body.get("messages")
        text_size = self.block_size * BYTES_PER_TOKEN
        text_limit = text_size * self.max_route_blocks
        if messages is not None:
            if not isinstance(messages, list):
                raise BadPrompt("messages must be a list of message objects", "body.messages")
            return [_chain(b"chat", _canonical_messages(messages, text_limit), text_size)]
        prompt = body.get("prompt")
        if prompt is None:
            return []
        if isinstance(prompt, str):
            items: list[Any] = [prompt]
        elif not isinstance(prompt, list):
            raise BadPrompt("prompt must be a string, a list of token ids or a list of either", "body.prompt")
        elif prompt and not isinstance(prompt[0], str | list):
            items = [prompt]  # one token-id prompt (validated as a whole below)
        else:
            items = prompt
        token_size = self.block_size * 8
        result = []
        for item in items:
            if isinstance(item, str):
                result.append(_chain(b"text", _text_bytes(item, text_limit, "body.prompt"), text_size))
            elif isinstance(item, list):
                packed = _token_bytes(item, token_size * self.max_route_blocks, "body.prompt")
                result.append(_chain(b"tokens", packed, token_size))
            else:
                raise BadPrompt("each prompt of a batch must be a string or a list of token ids", "body.prompt")
        return result

    # --- decisions -------------------------------------------------------------------------------
    def choose(self, adapter: str, prompts: list[Prompt], load: Mapping[str, int]) -> Decision:
        """Pick one of `load`'s replicas (url -> current load) for these prompts and record the choice."""
        if not load:
            raise ValueError("no replica to choose from")
        urls = list(load)
        specific = self._specific(adapter, prompts, urls)
        least = min(load.values())
        # Replicas not more than `imbalance` requests ahead of the least loaded; among them the one holding
        # the most specific blocks wins, the less loaded on ties.
        within = [url for url in urls if load[url] - least <= self.imbalance]
        best = max(within, key=lambda url: (specific[url], -load[url]))
        if self.mode == "round_robin":
            chosen = urls[self._next_rr(len(urls))]
        elif self.mode == "affinity" and specific[best] > 0:
            chosen = best
        else:
            idle = [url for url in urls if load[url] == least]
            chosen = idle[self._next_rr(len(idle))]
        held = any(specific.values())
        outcome: Outcome = "affinity" if specific[chosen] > 0 else "spilled" if held else "unmatched"
        self.counters["routed"] += 1
        self.counters[outcome] += 1
        self._record(adapter, prompts, chosen)
        return Decision(chosen, outcome, specific[chosen])

    def _next_rr(self, n: int) -> int:
        self._rr += 1
        return (self._rr - 1) % n

    def _specific(self, adapter: str, prompts: list[Prompt], urls: list[str]) -> dict[str, int]:
        """Blocks of these prompts each replica holds beyond the fleet-wide common prefix, summed over prompts."""
        specific = dict.fromkeys(urls, 0)
        table = self._tables.get(adapter)
        if table is None:
            return specific
        slots = {url: 1 << self._slots[url] for url in urls if url in self._slots}
        # Locals: this loop runs for every block of every request.
        young, old, known_common = table.young.get, table.old.get, self._common
        for prompt in prompts:
            held: list[int] = []  # held[d]: owner bits of the replicas that hold every block up to depth d + 1
            alive = -1
            common = 0
            for depth, key in enumerate(prompt.keys, start=1):
                entry = young(key)
                if entry is None:
                    entry = old(key)
                    if entry is None:
                        break
                if entry & _BRANCHED or key in known_common:
                    common = depth
                alive &= entry >> _OWNER_SHIFT
                if alive:
                    held.append(alive)
            if len(held) <= common:
                continue
            for url, bit in slots.items():
                depth = len(held)
                while depth > common and not held[depth - 1] & bit:
                    depth -= 1
                specific[url] += depth - common
        return specific

    def _slot(self, url: str) -> int:
        slot = self._slots.get(url)
        if slot is None:
            used = set(self._slots.values())
            slot = next(index for index in range(MAX_REPLICAS + 1) if index not in used)
            if slot >= MAX_REPLICAS:
                raise RuntimeError(f"the router tracks at most {MAX_REPLICAS} replicas")
            self._slots[url] = slot
        return slot

    def _record(self, adapter: str, prompts: list[Prompt], url: str) -> None:
        if not any(prompt.keys for prompt in prompts):
            return
        slot = self._slot(url)
        owner = 1 << (slot + _OWNER_SHIFT)
        table = self._tables.get(adapter)
        if table is None:
            table = self._tables[adapter] = _Table()
        self._tables.move_to_end(adapter)
        young, old = table.young, table.old
        for prompt in prompts:
            successor: int | None = None
            for key in reversed(prompt.keys):
                entry = young.get(key)
                promoted = entry is None
                if promoted:
                    entry = old.pop(key, None)
                    if entry is None:
                        entry = 0
                        self._count += 1
                updated = entry | owner
                if successor is not None and updated & _SUCC_SLOT_MASK != (slot + 1) << _SUCC_SLOT_SHIFT:
                    updated = _with_successor(updated, successor & _TAG_MASK, slot)
                    if updated & ~entry & _BRANCHED:
                        self._remember_common(key)
                if promoted or updated != entry:
                    young[key] = updated
                successor = key
        self._evict(table)

    def _remember_common(self, key: int) -> None:
        self._common[key] = None
        self._common.move_to_end(key)
        if len(self._common) > MAX_COMMON_BLOCKS:
            self._common.popitem(last=False)

    def _evict(self, current: _Table) -> None:
        if len(current.young) >= self.max_blocks // 2:  # the young half is full: it ages, the old one goes
            self._count -= len(current.old)
            current.old, current.young = current.young, {}
        while self._count > self.max_blocks:
            name, table = next(iter(self._tables.items()))
            if table.old:
                self._count -= len(table.old)
                table.old = {}
            elif table is current:
                break  # only the current adapter's young half is left: the next rotation bounds it
            else:
                self._count -= len(table.young)
                del self._tables[name]

    # --- forgetting ------------------------------------------------------------------------------
    def drop_adapter(self, adapter: str) -> None:
        """The adapter was unloaded: its blocks can never be hit again."""
        table = self._tables.pop(adapter, None)
        if table is not None:
            self._count -= len(table)

    def forget_replica(self, url: str) -> None:
        """The replica was ejected, restarted or removed: its prefix cache is gone (or unreachable)."""
        slot = self._slots.pop(url, None)
        if slot is None:
            return
        keep = ~(1 << (slot + _OWNER_SHIFT))
        for table in self._tables.values():
            for generation in (table.young, table.old):
                for key, entry in generation.items():
                    if entry & ~keep:
                        generation[key] = entry & keep

    def clear(self) -> None:
        """Every replica's prefix cache was reset (what is common stays common)."""
        self._tables.clear()
        self._count = 0

    def set_block_size(self, block_size: int) -> None:
        """Follow the replicas' KV block size; hashes of another size never match, so start over."""
        if block_size != self.block_size:
            self.block_size = block_size
            self.clear()
            self._common.clear()

    @property
    def tracked_blocks(self) -> int:
        return self._count


def _with_successor(entry: int, tag: int, slot: int) -> int:
    """Remember the first successor; a different successor on a different replica makes the block common."""
    first_slot = (entry & _SUCC_SLOT_MASK) >> _SUCC_SLOT_SHIFT
    if first_slot == 0:
        return entry | (slot + 1) << _SUCC_SLOT_SHIFT | tag << _SUCC_TAG_SHIFT
    first_tag = (entry & _SUCC_TAG_MASK) >> _SUCC_TAG_SHIFT
    if first_tag != tag and first_slot != slot + 1:
        return entry | _BRANCHED
    return entry
