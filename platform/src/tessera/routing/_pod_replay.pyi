from typing import Any

def replay(ints: memoryview, log_at: int, log_records: int, written_at: int, cursor: int, behind: int, row: int,
           entries: dict[int, Any], state: tuple[dict[Any, Any], ...], /) -> bool: ...
