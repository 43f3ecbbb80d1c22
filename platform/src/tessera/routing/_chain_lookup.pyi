from collections.abc import Sequence

def longest_prefixes(holders: dict[int, int], chain: Sequence[int], alive: int, names: list[str | None],
                     /) -> dict[str, int]: ...
