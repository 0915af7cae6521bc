"""Line numbers of the keys of a TOML text: tomllib gives none, and an error in a profile names
the line of the key at fault (:func:`key_lines`, :func:`line_for`)."""

from __future__ import annotations

import contextlib
import re
from typing import Mapping


def join_key(prefix: str, key: str) -> str:
    """``paths[1]`` and ``x`` -> ``paths[1].x``; the dotted keys of errors and :func:`key_lines`."""
    return f"{prefix}.{key}" if prefix else key


def _parent(key: str) -> str:
    """``paths[1].x`` -> ``paths[1]`` -> ``paths`` -> ``""``."""
    m = re.match(r"^(.*?)(?:\.[^.\[\]]+|\[\d+\])$", key)
    return m.group(1) if m else ""


def line_for(key: str, lines: Mapping[str, int], *, at_parent: bool = False) -> int | None:
    """The line of ``key`` (or of its parent), else of the nearest enclosing key that has one."""
    k = _parent(key) if at_parent else key
    while k:
        if k in lines:
            return lines[k]
        k = _parent(k)
    return None


def key_lines(text: str) -> dict[str, int]:
    """Line (1-based) of every key, table and array element of valid TOML ``text``, by dotted key
    (``host``, ``paths[1]``, ``paths[1].read_bytes_per_s.value``). Best effort: what it cannot
    follow is left out, and errors then name the nearest enclosing key's line."""
    sc = _KeyScanner(text)
    with contextlib.suppress(IndexError, ValueError):
        sc.document()
    return sc.lines


class _KeyScanner:
    """Walks TOML syntax (already validated by tomllib) and records where each key starts."""

    _BARE = re.compile(r"[A-Za-z0-9_-]+")

    def __init__(self, text: str) -> None:
        self.s, self.i, self.line = text, 0, 1
        self.lines: dict[str, int] = {}

    def _adv(self, n: int = 1) -> None:
        self.line += self.s.count("\n", self.i, self.i + n)
        self.i += n

    def _at(self, tok: str) -> bool:
        return self.s.startswith(tok, self.i)

    def _skip(self, newlines: bool) -> None:
        while self.i < len(self.s):
            c = self.s[self.i]
            if c in " \t" or (newlines and c in "\r\n"):
                self._adv()
            elif c == "#":
                end = self.s.find("\n", self.i)
                self._adv((len(self.s) if end < 0 else end) - self.i)
            else:
                return

    def _expect(self, tok: str) -> None:
        self._skip(False)
        if not self._at(tok):
            raise ValueError(f"expected {tok!r} at line {self.line}")
        self._adv(len(tok))

    def _record(self, key: str, line: int) -> None:
        self.lines.setdefault(key, line)

    def _string(self) -> str:
        for q in ('"""', "'''"):
            if self._at(q):
                end = self.s.index(q, self.i + 3)
                while self.s.startswith(q[0], end + 3):  # up to two quotes may end the content
                    end += 1
                raw = self.s[self.i + 3 : end]
                self._adv(end + 3 - self.i)
                return raw
        q = self.s[self.i]
        j = self.i + 1
        while self.s[j] != q:
            j += 2 if (q == '"' and self.s[j] == "\\") else 1
        raw = self.s[self.i + 1 : j]
        self._adv(j + 1 - self.i)
        return raw

    def _key(self) -> list[str]:
        parts = []
        while True:
            self._skip(False)
            if self.s[self.i] in "\"'":
                parts.append(self._string())
            else:
                m = self._BARE.match(self.s, self.i)
                if not m:
                    raise ValueError(f"no key at line {self.line}")
                parts.append(m.group())
                self._adv(m.end() - self.i)
            self._skip(False)
            if not self._at("."):
                return parts
            self._adv()

    def _value(self, key: str) -> None:
        self._skip(False)
        c = self.s[self.i]
        if c == "{":
            self._adv()
            while True:
                self._skip(False)
                if self._at("}"):
                    self._adv()
                    return
                line, parts = self.line, self._key()
                sub = key
                for p in parts:
                    sub = join_key(sub, p)
                    self._record(sub, line)
                self._expect("=")
                self._value(sub)
                self._skip(False)
                if self._at(","):
                    self._adv()
        elif c == "[":
            self._adv()
            n = 0
            while True:
                self._skip(True)
                if self._at("]"):
                    self._adv()
                    return
                self._record(f"{key}[{n}]", self.line)
                self._value(f"{key}[{n}]")
                n += 1
                self._skip(True)
                if self._at(","):
                    self._adv()
        elif c in "\"'":
            self._string()
        else:  # number, boolean, date-time (which may hold one space)
            m = re.compile(r"[^,\]}#\r\n]*").match(self.s, self.i)
            assert m is not None  # a run of zero or more characters always matches
            self._adv(m.end() - self.i)

    def document(self) -> None:
        table = ""
        arrays: dict[str, int] = {}  # array-of-tables key -> elements so far

        def resolve(parts: list[str]) -> str:
            k = ""
            for p in parts:
                k = join_key(k, p)
                if k in arrays:
                    k = f"{k}[{arrays[k] - 1}]"
            return k

        while True:
            self._skip(True)
            if self.i >= len(self.s):
                return
            line = self.line
            if self._at("[["):
                self._adv(2)
                parts = self._key()
                self._expect("]]")
                base = join_key(resolve(parts[:-1]), parts[-1])
                n = arrays.get(base, 0)
                arrays[base] = n + 1
                table = f"{base}[{n}]"
                self._record(base, line)
                self._record(table, line)
            elif self._at("["):
                self._adv()
                table = resolve(self._key())
                self._expect("]")
                self._record(table, line)
            else:
                key = table
                for p in self._key():
                    key = join_key(key, p)
                    self._record(key, line)
                self._expect("=")
                self._value(key)
