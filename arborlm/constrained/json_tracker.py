"""`JsonTracker`: follow JSON text byte by byte and report each value as it closes.

The semantic guard (`schema_guard`) feeds it the bytes of every accepted token. It keeps the
text so far, the stack of open objects and arrays, and for the value being written its
instance path (keys and indexes from the root), its start offset and, for a string, its length
in code points (as JSON Schema counts: an escape is one character, a surrogate pair of `\\u`
escapes one). `feed` returns the events the bytes caused, in order: `Close` for every value
that ended (innermost first; a number or literal ends at the byte after it, or at `finish`),
and one `Grow` for a string value still open at the end of the bytes.

Each open value carries a `site`: an opaque tag the owner computes from the parent's site and
the key or index (`resolve`), so the guard knows which schema applies without a second walk.
`snapshot` / `restore` save and restore the whole state (the text is append-only, so only its
length is saved); that is how a token is tried without changing state, and how rollback works.

It is no validator: it assumes the text is JSON (the grammar guarantees that) and ignores bytes
that make no sense where they come.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, NamedTuple

_WS = frozenset(b" \t\n\r")
_SCALAR_END = frozenset(b",]}") | _WS
# modes
_VALUE, _ARRAY_FIRST, _OBJECT_FIRST, _KEY, _COLON, _AFTER, _STRING, _SCALAR, _DONE = range(9)
_OBJECT, _ARRAY = 0, 1
# A frame is a list: [kind, start offset, path, site, children opened, last key]
_KIND, _START, _PATH, _SITE, _COUNT, _LAST_KEY = range(6)


class Close(NamedTuple):
    """A value ended: its text is `text[start:end]`; `parent` is the enclosing frame (or None)."""

    start: int
    end: int
    path: tuple[str | int, ...]
    site: Any
    parent: list[Any] | None
    length: int  # code points of a string value; 0 otherwise


class Grow(NamedTuple):
    """A string value is still open after the fed bytes, `length` code points long so far."""

    path: tuple[str | int, ...]
    site: Any
    length: int


class JsonTracker:
    __slots__ = ("text", "_resolve", "_root_site", "_stack", "_mode", "_str_key", "_str_len",
                 "_esc", "_hex", "_high", "_start", "_path", "_site")

    def __init__(self, root_site: Any, resolve: Callable[[Any, str | int], Any]):
        self.text = bytearray()
        self._resolve = resolve
        self._root_site = root_site
        self._stack: list[list[Any]] = []
        self._mode = _VALUE
        self._str_key = False
        self._str_len = 0
        self._esc = 0  # 0 none, 1 after a backslash, 2..5 reading \u hex digits
        self._hex = ""
        self._high = False  # the last escape was a high surrogate
        self._start = 0  # of the open string or scalar
        self._path: tuple[str | int, ...] = ()
        self._site: Any = root_site

    @property
    def done(self) -> bool:
        return self._mode == _DONE

    def snapshot(self) -> tuple[Any, ...]:
        return (len(self.text), tuple(tuple(f) for f in self._stack), self._mode, self._str_key,
                self._str_len, self._esc, self._hex, self._high, self._start, self._path,
                self._site)

    def restore(self, state: tuple[Any, ...]) -> None:
        (length, stack, self._mode, self._str_key, self._str_len, self._esc, self._hex,
         self._high, self._start, self._path, self._site) = state
        del self.text[length:]
        self._stack = [list(f) for f in stack]

    def open_values(self) -> list[tuple[int, Any, list[Any] | None]]:
        """The values open now, outermost first: (start offset, site, enclosing frame or None)."""
        out: list[tuple[int, Any, list[Any] | None]] = []
        parent = None
        for frame in self._stack:
            out.append((frame[_START], frame[_SITE], parent))
            parent = frame
        if self._mode == _SCALAR or (self._mode == _STRING and not self._str_key):
            out.append((self._start, self._site, parent))
        return out

    def clone(self) -> JsonTracker:
        twin = JsonTracker(self._root_site, self._resolve)
        twin.text = bytearray(self.text)
        twin.restore(self.snapshot())
        return twin

    def feed(self, data: bytes) -> list[Close | Grow]:
        events: list[Close | Grow] = []
        base = len(self.text)
        self.text += data
        for i, byte in enumerate(data):
            self._step(byte, base + i, events)
        if self._mode == _STRING and not self._str_key and data:
            events.append(Grow(self._path, self._site, self._str_len))
        return events

    def finish(self) -> list[Close | Grow]:
        """End of output: a number or literal still open at the root closes here."""
        events: list[Close | Grow] = []
        if self._mode == _SCALAR:
            self._close_scalar(len(self.text), events)
        return events

    # --- the state machine ----------------------------------------------------------------

    def _step(self, byte: int, pos: int, events: list[Close | Grow]) -> None:
        mode = self._mode
        if mode == _STRING:
            self._string_byte(byte, pos, events)
            return
        if mode == _SCALAR:
            if byte not in _SCALAR_END:
                return
            self._close_scalar(pos, events)
            mode = self._mode
        if byte in _WS or mode == _DONE:
            return
        if mode == _ARRAY_FIRST:
            if byte == 0x5D:  # ]
                self._close_container(pos, events)
                return
            mode = _VALUE
        if mode == _VALUE:
            self._open_value(byte, pos)
        elif mode in (_OBJECT_FIRST, _KEY):
            if byte == 0x7D and mode == _OBJECT_FIRST:  # }
                self._close_container(pos, events)
            elif byte == 0x22:  # "
                self._begin_string(pos, key=True)
        elif mode == _COLON:
            if byte == 0x3A:  # :
                self._mode = _VALUE
        elif mode == _AFTER:
            if byte == 0x2C:  # ,
                self._mode = _KEY if self._stack[-1][_KIND] == _OBJECT else _VALUE
            elif byte in (0x5D, 0x7D):
                self._close_container(pos, events)

    def _open_value(self, byte: int, pos: int) -> None:
        parent = self._stack[-1] if self._stack else None
        if parent is None:
            path, site = (), self._root_site
        else:
            if parent[_KIND] == _OBJECT:
                segment: str | int = parent[_LAST_KEY]
            else:
                segment = parent[_COUNT]
            parent[_COUNT] += 1
            path, site = parent[_PATH] + (segment,), self._resolve(parent[_SITE], segment)
        if byte in (0x7B, 0x5B):  # { [
            kind = _OBJECT if byte == 0x7B else _ARRAY
            self._stack.append([kind, pos, path, site, 0, None])
            self._mode = _OBJECT_FIRST if kind == _OBJECT else _ARRAY_FIRST
            return
        self._path, self._site = path, site
        if byte == 0x22:
            self._begin_string(pos, key=False)
        else:
            self._start = pos
            self._mode = _SCALAR

    def _begin_string(self, pos: int, key: bool) -> None:
        self._mode, self._str_key, self._str_len = _STRING, key, 0
        self._esc, self._high, self._start = 0, False, pos

    def _string_byte(self, byte: int, pos: int, events: list[Close | Grow]) -> None:
        if self._esc == 1:
            if byte == 0x75:  # u
                self._esc, self._hex = 2, ""
            else:
                self._esc, self._high = 0, False
                self._str_len += 1
        elif self._esc >= 2:
            self._hex += chr(byte)
            self._esc += 1
            if self._esc == 6:
                self._esc = 0
                code = int(self._hex, 16) if len(self._hex) == 4 else 0
                low = 0xDC00 <= code <= 0xDFFF
                if not (low and self._high):
                    self._str_len += 1
                self._high = 0xD800 <= code <= 0xDBFF
        elif byte == 0x5C:  # backslash
            self._esc = 1
        elif byte == 0x22:
            if self._str_key:
                if self._stack:
                    self._stack[-1][_LAST_KEY] = _key(bytes(self.text[self._start:pos + 1]))
                self._mode = _COLON
            else:
                self._mode = _AFTER if self._stack else _DONE
                events.append(Close(self._start, pos + 1, self._path, self._site,
                                    self._stack[-1] if self._stack else None, self._str_len))
        elif byte & 0xC0 != 0x80:  # not a UTF-8 continuation byte: one more code point
            self._high = False
            self._str_len += 1

    def _close_scalar(self, pos: int, events: list[Close | Grow]) -> None:
        self._mode = _AFTER if self._stack else _DONE
        events.append(Close(self._start, pos, self._path, self._site,
                            self._stack[-1] if self._stack else None, 0))

    def _close_container(self, pos: int, events: list[Close | Grow]) -> None:
        frame = self._stack.pop()
        self._mode = _AFTER if self._stack else _DONE
        events.append(Close(frame[_START], pos + 1, frame[_PATH], frame[_SITE],
                            self._stack[-1] if self._stack else None, 0))


def _key(raw: bytes) -> str:
    """A property name from its JSON text (undecodable bytes replaced, never an error)."""
    try:
        return json.loads(raw)
    except ValueError:
        return json.loads(raw.decode("utf-8", errors="replace"), strict=False)


def pointer(path: tuple[str | int, ...]) -> str:
    """The JSON pointer of an instance path ("" for the root)."""
    return "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in path)
