"""Server-sent events from a stdlib HTTP handler, as the engines' HTTP servers send a streamed answer:
shared by the lab's engine stand-ins (stdlib only; installed into a lab container as ``gpugate_sse``).

What it copies: an engine answers ``"stream": true`` with Starlette's ``StreamingResponse(...,
media_type="text/event-stream")`` under uvicorn (SGLang's ``http_server.py`` ``generate_request``
and its OpenAI ``serving_chat.py`` / ``serving_completions.py``; vLLM's OpenAI server the same way):

- status 200 and ``content-type: text/event-stream; charset=utf-8`` (Starlette adds the charset to a
  text type), no content-length: uvicorn sends the body with ``transfer-encoding: chunked``;
- one event per ``yield``: ``data: <compact JSON>\\n\\n``, each sent as soon as it is made (an HTTP
  chunk of its own), then ``data: [DONE]\\n\\n`` and the chunked body's end (a zero-length chunk);
- a server that dies mid-stream (SIGKILL, the kernel closes its socket) never sends that end: the
  client reads a truncated chunked body, an error (the OpenAI client raises; httpx says "incomplete
  chunked read"), never a short answer that looks whole;
- a client that goes away mid-stream makes the next write fail: :class:`ClientGone`, on which the
  engine aborts the request (SGLang's ``create_abort_task`` on the disconnect).

Example (in a ``BaseHTTPRequestHandler`` with ``protocol_version = "HTTP/1.1"``)::

    stream = EventStream(self)
    stream.start()
    stream.data({"text": " lab", "meta_info": {"completion_tokens": 1}})
    stream.done()            # data: [DONE], then the body's end

>>> event({"text": "hi"})
b'data: {"text":"hi"}\\n\\n'
>>> chunk(b"data: [DONE]\\n\\n")
b'e\\r\\ndata: [DONE]\\n\\n\\r\\n'
"""

from __future__ import annotations

import json

CONTENT_TYPE = "text/event-stream; charset=utf-8"
DONE = b"data: [DONE]\n\n"


class ClientGone(Exception):
    """The client closed the connection mid-stream (a write failed)."""


def event(obj) -> bytes:
    """One server-sent event: ``data: `` and the object as compact JSON (orjson's and pydantic's
    ``model_dump_json`` have no spaces), then a blank line."""
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def chunk(data: bytes) -> bytes:
    """``data`` as one HTTP/1.1 chunk (hex length, CRLF, data, CRLF); ``b""`` is the body's end."""
    return b"%x\r\n%s\r\n" % (len(data), data)


class EventStream:
    """A streamed answer on one request of ``handler`` (a ``BaseHTTPRequestHandler``)."""

    def __init__(self, handler) -> None:
        self.handler = handler
        self.ended = False

    def start(self, status: int = 200) -> None:
        """The status line and the headers; the body follows in chunks."""
        handler = self.handler
        handler.send_response(status)
        handler.send_header("content-type", CONTENT_TYPE)
        handler.send_header("transfer-encoding", "chunked")
        handler.end_headers()
        handler.wfile.flush()

    def _write(self, data: bytes) -> None:
        try:
            self.handler.wfile.write(data)
            self.handler.wfile.flush()
        except (BrokenPipeError, ConnectionResetError, ConnectionAbortedError) as exc:
            self.handler.close_connection = True
            raise ClientGone(str(exc)) from None

    def data(self, obj) -> None:
        """One ``data: {...}`` event, sent now."""
        self._write(chunk(event(obj)))

    def done(self) -> None:
        """``data: [DONE]`` and the end of the body (the connection may be kept for the next request)."""
        if not self.ended:
            self.ended = True
            self._write(chunk(DONE) + chunk(b""))
