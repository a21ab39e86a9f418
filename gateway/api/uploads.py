"""A multipart/form-data upload (RFC 7578) streamed into the state store as it arrives.

python-multipart's push parser (the one Starlette uses for forms) reads the request body a piece at a time;
the `file` part's bytes go to the store's `Upload` writer in pieces of at most FILE_CHUNK, so the gateway
holds about one piece of an upload, whatever its size. Small fields (purpose, expires_after[...]) are kept,
up to 1 KiB each. The file is checked on the way: at most `limit` bytes, UTF-8 (an incremental decoder,
so a character split between pieces is fine). Anything wrong: the partial file is removed and a 400/413.
"""

from __future__ import annotations

import codecs
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from python_multipart.multipart import MultipartParseError, MultipartParser, parse_options_header

from gateway.state.jobs import FILE_CHUNK, Upload
from gateway.wire import errors
from gateway.wire.errors import GatewayError

FIELD_LIMIT = 1024  # bytes of a non-file field
# The parser logs a warning for each malformed body it sees: a client could fill the log. The client gets a 400.
logging.getLogger("python_multipart.multipart").setLevel(logging.ERROR)


@dataclass(slots=True)
class Received:
    fields: dict[str, str] = field(default_factory=dict)
    filename: str | None = None
    size: int = 0
    got_file: bool = False


class _Parts:
    """The parser's callbacks: collect fields, queue the file part's bytes for the writer."""

    def __init__(self, limit: int, too_large: GatewayError) -> None:
        self.limit = limit
        self.too_large = too_large
        self.out = Received()
        self.pending: list[bytes] = []
        self.pending_bytes = 0
        self._header_name = b""
        self._headers: dict[bytes, bytes] = {}
        self._name: str | None = None
        self._is_file = False
        self._value = bytearray()
        self._utf8 = codecs.getincrementaldecoder("utf-8")()

    def callbacks(self) -> dict:
        return {"on_part_begin": self.part_begin, "on_header_field": self.header_field,
                "on_header_value": self.header_value, "on_header_end": self.header_end,
                "on_part_data": self.part_data, "on_part_end": self.part_end}

    def part_begin(self) -> None:
        self._headers, self._header_name, self._name, self._is_file = {}, b"", None, False
        self._value = bytearray()

    def header_field(self, data: bytes, start: int, end: int) -> None:
        self._header_name += data[start:end]

    def header_value(self, data: bytes, start: int, end: int) -> None:
        key = self._header_name.lower()
        self._headers[key] = self._headers.get(key, b"") + data[start:end]
        if len(self._headers[key]) > FIELD_LIMIT:
            raise errors.bad_request("Malformed multipart body: a part header is too long.")

    def header_end(self) -> None:
        if self._header_name.lower() == b"content-disposition":
            _, params = parse_options_header(self._headers[b"content-disposition"])
            name = params.get(b"name")
            self._name = name.decode("utf-8", "replace") if name is not None else None
            filename = params.get(b"filename")
            if self._name == "file":
                self._is_file = True
                self.out.got_file = True
                self.out.filename = filename.decode("utf-8", "replace") if filename else None
        self._header_name = b""

    def part_data(self, data: bytes, start: int, end: int) -> None:
        if self._is_file:
            n = end - start
            self.out.size += n
            if self.out.size > self.limit:
                raise self.too_large
            piece = data[start:end]
            try:
                self._utf8.decode(piece)
            except UnicodeDecodeError:
                raise errors.bad_request("The file must be UTF-8 encoded JSONL.", "file") from None
            self.pending.append(piece)
            self.pending_bytes += n
        else:
            self._value += data[start:end]
            if len(self._value) > FIELD_LIMIT:
                raise errors.bad_request(f"The multipart field {self._name!r} is too long.", self._name)

    def part_end(self) -> None:
        if self._is_file:
            try:
                self._utf8.decode(b"", final=True)
            except UnicodeDecodeError:
                raise errors.bad_request("The file must be UTF-8 encoded JSONL.", "file") from None
        elif self._name is not None:
            self.out.fields[self._name] = self._value.decode("utf-8", "replace").strip()

    def take(self) -> bytes:
        data = b"".join(self.pending)
        self.pending, self.pending_bytes = [], 0
        return data


async def receive_upload(body: AsyncIterator[bytes], content_type: str, writer: Upload, limit: int,
                         too_large: GatewayError) -> Received:
    """Parse the multipart body from `body`, writing the `file` part to `writer` (not committed here);
    on any error the writer is aborted and the error raised."""
    ctype, params = parse_options_header(content_type)
    boundary = params.get(b"boundary")
    if ctype != b"multipart/form-data" or not boundary:
        raise errors.bad_request("Upload the file as multipart/form-data with fields `file` and `purpose`.")
    parts = _Parts(limit, too_large)
    parser = MultipartParser(boundary, parts.callbacks())
    try:
        async for chunk in body:
            parser.write(chunk)
            if parts.pending_bytes >= FILE_CHUNK:
                await writer.write(parts.take())
        parser.finalize()
        if parts.pending:
            await writer.write(parts.take())
    except MultipartParseError as e:
        await writer.abort()
        raise errors.bad_request(f"Malformed multipart body: {e}") from None
    except BaseException:
        await writer.abort()
        raise
    if not parts.out.got_file:
        await writer.abort()
        raise errors.bad_request("The multipart field `file` is required.", "file")
    return parts.out
