"""web/sse.py: the SSE wire format, byte for byte."""
from __future__ import annotations

import msgspec
import pytest

from web import sse


def test_simple_event() -> None:
    assert sse.event("hello", event="epoch", id=7) == b"id: 7\nevent: epoch\ndata: hello\n\n"


def test_data_only() -> None:
    assert sse.event("x") == b"data: x\n\n"


def test_empty_data_is_one_empty_data_line() -> None:
    assert sse.event("") == b"data: \n\n"


@pytest.mark.parametrize("text", ["a\nb\nc", "a\r\nb\r\nc", "a\rb\rc", "a\nb\r\nc"])
def test_multiline_data_split_into_data_lines(text: str) -> None:
    assert sse.event(text, event="run", id=1) == b"id: 1\nevent: run\ndata: a\ndata: b\ndata: c\n\n"


def test_trailing_newline_gives_empty_last_data_line() -> None:
    assert sse.event("a\n") == b"data: a\ndata: \n\n"


def test_newlines_stripped_from_id_and_event() -> None:
    got = sse.event("d", event="ep\r\noch\n", id="1\n2\r3")
    assert got == b"id: 123\nevent: epoch\ndata: d\n\n"


def test_nul_stripped_from_id() -> None:
    assert sse.event("d", id="4\x002") == b"id: 42\ndata: d\n\n"


def test_a_payload_cannot_inject_a_field_or_end_the_event() -> None:
    got = sse.event("x\n\nevent: evil\nid: 999", event="run", id=3)
    assert got == b"id: 3\nevent: run\ndata: x\ndata: \ndata: event: evil\ndata: id: 999\n\n"
    assert got.count(b"\n\n") == 1 and got.endswith(b"\n\n")


def test_retry_line() -> None:
    assert sse.retry(2000) == b"retry: 2000\n\n"
    assert sse.event(retry=1500) == b"retry: 1500\n\n"


def test_comments() -> None:
    assert sse.comment("ping") == b": ping\n\n"
    assert sse.comment("a\nb") == b": a\n: b\n\n"
    assert sse.PING == b": ping\n\n"


def test_field_order() -> None:
    got = sse.event("d", event="e", id=1, retry=5, comment="c")
    assert got == b": c\nid: 1\nevent: e\nretry: 5\ndata: d\n\n"


def test_utf8() -> None:
    assert sse.event("żółw ✓", event="run", id=1) == "id: 1\nevent: run\ndata: żółw ✓\n\n".encode()


def test_json_event_is_compact_single_line_with_null_for_non_finite() -> None:
    payload = {"loss": float("nan"), "up": float("inf"), "down": float("-inf"),
               "text": "two\nlines", "n": 3}
    got = sse.json_event("epoch", 12, payload)
    assert got == (b'id: 12\nevent: epoch\n'
                   b'data: {"loss":null,"up":null,"down":null,"text":"two\\nlines","n":3}\n\n')


@pytest.mark.parametrize("payload", [
    {"text": "cr\rlf\ncrlf\r\n", "sep": "\u2028\u2029", "uni": "żółw ✓ \U0001F600"},
    [{"rank": i, "host": "h" * 50, "loss": i / 7} for i in range(2000)],
    "plain", None, 3.5, [],
])
def test_json_event_bytes_equal_the_general_formatter(payload: object) -> None:
    """json_event assembles bytes around the encoder's output (no decode, split, re-encode
    of megabyte payloads); it must write exactly what ``event`` writes for the same JSON."""
    text = msgspec.json.encode(payload).decode()
    assert sse.json_event("ranks", 7, payload) == sse.event(text, event="ranks", id=7)
