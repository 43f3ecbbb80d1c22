"""The per-request record: what the client observed about one request, and nothing derived.

Every metric in `metrics.py` is a pure function of these records, so a run can be re-analysed from its
JSONL file. Times are seconds on the monotonic clock (`time.perf_counter`), absolute inside a run; the
result files store them relative to the run's start.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final

# Error kinds a record can carry. HTTP errors are "http_<status>".
ERROR_TIMEOUT: Final = "timeout"
ERROR_CONNECT: Final = "connect"
ERROR_BROKEN_STREAM: Final = "broken_stream"
ERROR_STREAM_ERROR: Final = "stream_error"
ERROR_EMPTY_OUTPUT: Final = "empty_output"
ERROR_BAD_RESPONSE: Final = "bad_response"
ERROR_INCOMPLETE: Final = "incomplete"

N_OUT_FROM_USAGE: Final = "usage"
N_OUT_FROM_CHUNKS: Final = "client_chunks"


def http_error_kind(status: int) -> str:
    """The error kind of an HTTP error status, e.g. ``http_429``."""
    return f"http_{status}"


@dataclass(slots=True)
class RequestRecord:
    """One request as the client saw it (see ``shared/metrics.md`` for the names).

    ``chunk_times`` holds the arrival time of every content chunk (a chunk whose text is non-empty), so
    ``chunk_times[0] == t_first`` and ``chunk_times[-1] == t_last``. ``chunk_tokens[i]`` is the number of
    tokens chunk ``i`` carries, known when the server streams cumulative usage; ``None`` when it does not.
    ``n_in_asked`` is the prompt length the workload asked for (in the model's tokens when the run had its
    tokenizer, else in words), to compare with the server's ``n_in``; ``None`` for prompts taken from
    data (ShareGPT) and, without a tokenizer, for conversation turns after the first.
    """

    request_id: str
    tenant: str
    request_class: str
    endpoint: str
    stream: bool
    t_sched: float
    warmup: bool = False
    session_id: str | None = None
    turn: int = 0
    max_tokens: int = 0
    trace_id: str = ""
    server_request_id: str | None = None
    t_send_first: float | None = None
    t_send: float | None = None
    t_first: float | None = None
    t_last: float | None = None
    t_done: float | None = None
    n_in: int | None = None
    n_in_asked: int | None = None
    n_out: int | None = None
    n_out_source: str = N_OUT_FROM_USAGE
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] | None = None
    http_status: int | None = None
    error_kind: str | None = None
    error_detail: str = ""
    num_429: int = 0
    num_429_retry_after: int = 0
    retry_wait_s: float = 0.0
    text: str | None = None

    @property
    def ok(self) -> bool:
        """The request completed with a usable response."""
        return self.error_kind is None and self.t_done is not None

    def fail(self, kind: str, detail: str = "", now: float | None = None) -> None:
        """Mark the request failed; the first failure wins."""
        if self.error_kind is None:
            self.error_kind = kind
            self.error_detail = detail[:300]
        if self.t_done is None:
            self.t_done = now

    def to_json(self, t0: float) -> dict[str, Any]:
        """The JSONL form: times relative to ``t0``, rounded to the microsecond."""

        def rel(t: float | None) -> float | None:
            return None if t is None else round(t - t0, 6)

        first = self.t_first
        return {
            "request_id": self.request_id,
            "trace_id": self.trace_id,
            "server_request_id": self.server_request_id,
            "tenant": self.tenant,
            "request_class": self.request_class,
            "endpoint": self.endpoint,
            "stream": self.stream,
            "session_id": self.session_id,
            "turn": self.turn,
            "warmup": self.warmup,
            "ok": self.ok,
            "error_kind": self.error_kind,
            "error_detail": self.error_detail or None,
            "http_status": self.http_status,
            "t_sched": rel(self.t_sched),
            "t_send_first": rel(self.t_send_first),
            "t_send": rel(self.t_send),
            "t_first": rel(self.t_first),
            "t_last": rel(self.t_last),
            "t_done": rel(self.t_done),
            "max_tokens": self.max_tokens,
            "n_in": self.n_in,
            "n_in_asked": self.n_in_asked,
            "n_out": self.n_out,
            "n_out_source": self.n_out_source,
            "num_429": self.num_429,
            "num_429_retry_after": self.num_429_retry_after,
            "retry_wait_s": round(self.retry_wait_s, 6),
            "chunk_offsets_s": [round(t - first, 6) for t in self.chunk_times] if first is not None else [],
            "chunk_tokens": self.chunk_tokens,
        }

    @classmethod
    def from_json(cls, row: dict[str, Any]) -> RequestRecord:
        """Rebuild a record from its JSONL form (times stay relative to the run's start)."""
        first = row.get("t_first")
        offsets = row.get("chunk_offsets_s") or []
        return cls(
            request_id=row["request_id"],
            tenant=row["tenant"],
            request_class=row["request_class"],
            endpoint=row["endpoint"],
            stream=row["stream"],
            t_sched=row["t_sched"],
            warmup=row.get("warmup", False),
            session_id=row.get("session_id"),
            turn=row.get("turn", 0),
            max_tokens=row.get("max_tokens", 0),
            trace_id=row.get("trace_id", ""),
            server_request_id=row.get("server_request_id"),
            t_send_first=row.get("t_send_first"),
            t_send=row.get("t_send"),
            t_first=first,
            t_last=row.get("t_last"),
            t_done=row.get("t_done"),
            n_in=row.get("n_in"),
            n_in_asked=row.get("n_in_asked"),
            n_out=row.get("n_out"),
            n_out_source=row.get("n_out_source", N_OUT_FROM_USAGE),
            chunk_times=[first + o for o in offsets] if first is not None else [],
            chunk_tokens=row.get("chunk_tokens"),
            http_status=row.get("http_status"),
            error_kind=row.get("error_kind"),
            error_detail=row.get("error_detail") or "",
            num_429=row.get("num_429", 0),
            num_429_retry_after=row.get("num_429_retry_after", 0),
            retry_wait_s=row.get("retry_wait_s", 0.0),
        )
