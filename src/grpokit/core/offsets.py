"""Character offsets in a completion's text → the tokens that end there: where process supervision's steps (and
a process reward model's steps) end, in the completion's tokens."""

from __future__ import annotations

from collections.abc import Sequence


def step_token_ends(tokenizer, ids: Sequence[int], text: str, offsets: Sequence[int]) -> list[int]:
    """Map character offsets in a completion's text to the indices of the tokens that end there.

    ``ids``: the completion's tokens (up to where it stopped, EOS included); ``text``: their decoded
    form as reward functions see it (``Rollout.decode``); ``offsets``: character positions where steps
    end (exclusive, as in ``text[:offset]``). A step ends at the token holding its last character, so a
    token that spans a step boundary belongs to the step it starts in; ``len(text)`` maps to the
    completion's last token (its EOS, which then shares the final step's advantage).

    Fast path: the tokenizer's offset mapping, when re-encoding ``text`` gives back exactly the
    sampled tokens with contiguous offsets. Otherwise (a non-canonical sample, trimmed offsets) it
    bisects on the length of decoded prefixes, which is exact for any tokenizer.
    """
    if not ids:
        if any(offsets):
            raise ValueError(f"step offsets {list(offsets)} given for an empty completion")
        return []
    char_ends = _char_ends_from_offsets(tokenizer, ids, text)
    if char_ends is None:
        cache: dict[int, int] = {}

        def prefix_length(k: int) -> int:  # characters in the decoded first k + 1 tokens
            if k not in cache:
                cache[k] = len(tokenizer.decode(list(ids[: k + 1]), skip_special_tokens=True))
            return cache[k]
    else:
        prefix_length = char_ends.__getitem__
    last = len(ids) - 1
    result = []
    for offset in offsets:
        if not 0 <= offset <= len(text):
            raise ValueError(f"step offset {offset} is outside the completion's text [0, {len(text)}]")
        if offset == len(text):
            result.append(last)
            continue
        low, high = 0, last  # the first token whose decoded prefix reaches ``offset``
        while low < high:
            mid = (low + high) // 2
            if prefix_length(mid) >= offset:
                high = mid
            else:
                low = mid + 1
        result.append(low)
    return result


def _char_ends_from_offsets(tokenizer, ids: Sequence[int], text: str) -> list[int] | None:
    """Per token, where its text ends in ``text``, from the offset mapping; None when unusable."""
    if not getattr(tokenizer, "is_fast", False):
        return None
    special = set(tokenizer.all_special_ids)
    kept = [i for i in ids if i not in special]
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    spans = encoded["offset_mapping"]
    if encoded["input_ids"] != kept or (spans and (spans[0][0] != 0 or spans[-1][1] != len(text))):
        return None
    if any(spans[k][1] != spans[k + 1][0] for k in range(len(spans) - 1)):
        return None  # trimmed (whitespace) or overlapping offsets do not tile the text
    char_ends, position, end = [], 0, 0
    for token in ids:
        if token not in special:
            end = spans[position][1]
            position += 1
        char_ends.append(end)
    return char_ends
