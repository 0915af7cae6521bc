"""Hardware profiles as strict TOML files: where they live, how they are read and written.

The strict check is derived from the dataclass annotations of :mod:`perf.profile` (str, int,
float, bool, ``Literal``, tuples, nested and optional dataclasses), so the schema has one
definition. An unknown key, a value of the wrong type, a missing required key, another
``schema_version`` or a TOML syntax error is a :class:`ConfigError` naming the file, the dotted
key (``paths[1].read_bytes_per_s.value``) and its line. tomllib gives no line numbers for
keys, so :func:`perf.toml_lines.key_lines` finds them in the source text.

Files are written with tomli-w formatting every value; figures are inline tables
(``{ value = ..., how = "...", when = "..." }``) so that a profile reads as one line per figure.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import os
import re
import sys
import types
import typing
from datetime import datetime
from typing import Any, Literal, Mapping

import tomli_w

from engine.errors import ConfigError
from engine.text import printable
from perf.profile import SCHEMA_VERSION, Figure, Profile
from perf.toml_lines import join_key, key_lines, line_for

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

PROFILE_DIR_ENV = "OFFLOADCTL_PROFILE_DIR"
SUFFIX = ".toml"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


# -- where profiles live -------------------------------------------------------------------------


def profile_dir() -> str:
    """``$OFFLOADCTL_PROFILE_DIR``, else ``$XDG_CONFIG_HOME/offloadctl/profiles`` (default
    ``~/.config/offloadctl/profiles``). Not created here."""
    d = os.environ.get(PROFILE_DIR_ENV)
    if d:
        return os.path.abspath(os.path.expanduser(d))
    config = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return os.path.join(config, "offloadctl", "profiles")


def check_name(name: str) -> str:
    """``name`` if it can be a profile's file name, else a :class:`ConfigError`."""
    if not isinstance(name, str) or not _NAME_RE.match(name) or name.endswith(SUFFIX):
        raise ConfigError(
            f"profile name {name!r} is not usable as a file name: use letters, digits, '.', '_' and '-' "
            f"(no '/', no {SUFFIX} suffix), e.g. 'h100-node'"
        )
    return name


def path_for_name(name: str, directory: str | None = None) -> str:
    return os.path.join(directory or profile_dir(), check_name(name) + SUFFIX)


def list_profiles(directory: str | None = None) -> list[str]:
    """Names of the profiles in ``directory`` (default :func:`profile_dir`), sorted."""
    try:
        entries = os.listdir(directory or profile_dir())
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(e[: -len(SUFFIX)] for e in entries if e.endswith(SUFFIX) and not e.startswith("."))


def file_kind(path: str) -> str:
    """What ``path`` is, as messages say it ("a directory", "a FIFO"...)."""
    import stat

    mode = os.stat(path).st_mode
    for test, kind in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return kind
    return "not a regular file"


def resolve_profile(name_or_path: str) -> str:
    """The file of ``name_or_path``: an existing file, or a name in :func:`profile_dir`."""
    s = os.fspath(name_or_path)
    if os.path.isfile(s):
        return os.path.abspath(s)
    if os.path.exists(s):  # a directory, a FIFO, a device: not a file to read a profile from
        raise ConfigError(f"profile {s} is {file_kind(s)}, not a profile file: give a profile's .toml file or its name")
    if os.sep in s or s.endswith(SUFFIX):
        raise ConfigError(
            f"profile file {s} does not exist: check the path, or give a profile name from `offloadctl profile list`"
        )
    d = profile_dir()
    candidate = os.path.join(d, s + SUFFIX)
    if _NAME_RE.match(s) and os.path.isfile(candidate):
        return candidate
    names = list_profiles(d)
    have = f"available: {', '.join(names)}" if names else "there are none yet"
    raise ConfigError(
        f"no profile named {s!r} in {d} ({have}): measure one with `offloadctl profile save {s}`, "
        f"or give the path of a profile file"
    )


# -- reading -------------------------------------------------------------------------------------


def load_profile(name_or_path: str) -> Profile:
    """Read and strictly check a profile given by file path or by name."""
    path = resolve_profile(name_or_path)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ConfigError(f"cannot read profile {path} ({e.strerror}): fix its permissions or give another file") from None
    return loads_profile(raw, file=path)


def loads_profile(text: str | bytes, *, file: str = "<profile>") -> Profile:
    """Parse profile TOML text; errors name ``file``."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(f"profile {file} is not UTF-8 text (byte {e.start}): save it as UTF-8") from None
    try:
        data = tomllib.loads(text)
        return profile_from_dict(data, key_lines(text), file=file)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(
            f"profile {file} is not valid TOML: {e}; fix the syntax there, or re-create the profile "
            f"with `offloadctl profile save`"
        ) from None
    except RecursionError:  # arrays or tables nested thousands deep: no profile looks like that
        raise ConfigError(
            f"profile {file} nests arrays or tables too deeply to read: it is not a profile; re-create "
            f"it with `offloadctl profile save`"
        ) from None


class _SchemaError(Exception):
    """Internal: a fault at a dotted key; turned into a ConfigError with file and line."""

    def __init__(self, key: str, problem: str, fix: str, *, at_parent: bool = False) -> None:
        super().__init__(problem)
        self.key, self.problem, self.fix, self.at_parent = key, problem, fix, at_parent


def profile_from_dict(d: Mapping[str, Any], lines: Mapping[str, int] | None = None, *, file: str = "<profile>") -> Profile:
    """A :class:`Profile` from parsed TOML ``d``, checked strictly against the schema.

    ``lines`` maps dotted keys to line numbers (from :func:`key_lines`) for the error messages.
    """
    lines = lines or {}
    try:
        if not isinstance(d, Mapping):
            raise _SchemaError("", f"is a {_kind(d)}, not a table", "give the parsed TOML document")
        _check_version(d)
        return _convert(d, Profile, "")
    except _SchemaError as e:
        line = line_for(e.key, lines, at_parent=e.at_parent)
        where = f"profile {file}" + (f", line {line}" if line else "")
        what = f"key {e.key}" if e.key else "the document"
        raise ConfigError(f"{where}: {what} {e.problem}: {e.fix}") from None


def _check_version(d: Mapping[str, Any]) -> None:
    if "schema_version" not in d:
        raise _SchemaError(
            "schema_version",
            "is missing",
            f"add `schema_version = {SCHEMA_VERSION}` at the top (the schema this offloadctl reads)",
            at_parent=True,
        )
    v = d["schema_version"]
    if type(v) is not int:
        raise _SchemaError(
            "schema_version", f"must be an integer, got {_kind(v)} {v!r}", f"write `schema_version = {SCHEMA_VERSION}`"
        )
    if v != SCHEMA_VERSION:
        raise _SchemaError(
            "schema_version",
            f"is {v}, but this offloadctl reads schema version {SCHEMA_VERSION} only",
            "re-measure with `offloadctl profile save`, or use the offloadctl version that wrote it",
        )


@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


_KINDS: tuple[tuple[type, str], ...] = (
    (bool, "a boolean"),  # before int: a bool is an int
    (int, "an integer"),
    (float, "a float"),
    (str, "a string"),
    (Mapping, "a table"),
    (list, "an array"),
)


def _kind(v: Any) -> str:
    """How a TOML value is called in messages."""
    return next((word for t, word in _KINDS if isinstance(v, t)), f"a {type(v).__name__}")


def _convert(v: Any, tp: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        out = _convert_dataclass(v, tp, key)
        if tp is Figure and out.value <= 0 and re.search(r"(_per_s|bandwidth)$", key):
            # A rate of 0 is no measurement: the plan divides by it (what show accepts, plan uses).
            raise _SchemaError(
                f"{key}.value",
                f"is a rate and must be above 0, got {out.value!r}",
                "write the measured rate, or measure again with `offloadctl profile save`",
            )
        return out
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(options) != 1:
            raise TypeError(f"unsupported schema type {tp!r} at {key}")
        return _convert(v, options[0], key)
    if origin is Literal:
        allowed = typing.get_args(tp)
        if any(type(v) is type(a) and v == a for a in allowed):
            return v
        shown = ", ".join(repr(a) for a in allowed)
        raise _SchemaError(key, f"must be one of {shown}, got {_kind(v)} {v!r}", f"write one of {shown}")
    if origin is tuple:
        args = typing.get_args(tp)
        if len(args) != 2 or args[1] is not Ellipsis:
            raise TypeError(f"unsupported schema type {tp!r} at {key}")
        if not isinstance(v, list):
            raise _SchemaError(key, f"must be an array, got {_kind(v)}", "write an array `[...]` or [[tables]]")
        return tuple(_convert(x, args[0], f"{key}[{i}]") for i, x in enumerate(v))
    if tp is bool:
        if type(v) is not bool:
            raise _SchemaError(key, f"must be true or false, got {_kind(v)} {v!r}", "write true or false")
        return v
    if tp is int:
        if type(v) is not int:
            raise _SchemaError(
                key, f"must be an integer, got {_kind(v)} {v!r}", "write a whole number without quotes or a decimal point"
            )
        if v < 0:
            raise _SchemaError(key, f"must not be negative, got {v}", "write a count or size of 0 or more")
        return v
    if tp is float:
        if type(v) not in (int, float):  # an integer is a fine float; a boolean is not a number
            raise _SchemaError(key, f"must be a number, got {_kind(v)} {v!r}", "write a number without quotes, e.g. 1.5e9")
        if not math.isfinite(v) or v < 0:
            raise _SchemaError(
                key, f"must be a finite number of 0 or more, got {v!r}", "write a measured or declared value, e.g. 1.5e9"
            )
        return float(v)
    if tp is str:
        if type(v) is not str:
            raise _SchemaError(key, f"must be a string, got {_kind(v)} {v!r}", 'write it in double quotes, "like this"')
        return printable(v)  # an escape sequence in a name or a note is never shown to a terminal
    raise TypeError(f"unsupported schema type {tp!r} at {key}")


def _convert_dataclass(v: Any, cls: type, key: str) -> Any:
    if not isinstance(v, Mapping):
        raise _SchemaError(
            key,
            f"must be a table, got {_kind(v)} {v!r}",
            f"write a table with keys {', '.join(f.name for f in dataclasses.fields(cls))}",
        )
    hints = _hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for k in v:
        if k not in fields:
            close = difflib.get_close_matches(str(k), list(fields), n=1, cutoff=0.6)
            if close:  # the key it is a typo of says more than the whole list
                raise _SchemaError(join_key(key, k), f"is not a key of {_table_name(key)}", f"did you mean {close[0]}?")
            raise _SchemaError(
                join_key(key, k), f"is not a key of {_table_name(key)} ({', '.join(fields)})", "remove it, or fix its spelling"
            )
    kwargs = {}
    for name, f in fields.items():
        sub = join_key(key, name)
        if name not in v:
            required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            if required:
                table = dataclasses.is_dataclass(hints[name]) and not key
                raise _SchemaError(
                    sub,
                    f"is missing ({_table_name(key)} needs {', '.join(_required(cls))})",
                    f"add a [{name}] table" if table else f"add `{name} = ...`",
                    at_parent=True,
                )
            continue
        kwargs[name] = _convert(v[name], hints[name], sub)
    _check_values(cls, kwargs, key)
    return cls(**kwargs)


def _table_name(key: str) -> str:
    """The TOML table at dotted ``key``, as the file writes it: ``[machine]``, ``[[paths]]``
    (an entry of an array of tables), ``the top level``; never a Python class."""
    if not key:
        return "the top level"
    array = re.sub(r"\[\d+\]$", "", key)
    if "." in key:
        return f"table {key}"
    return f"[[{array}]]" if array != key else f"[{key}]"


def _check_values(cls: type, kw: dict, key: str) -> None:
    """Checks beyond types: provenance of every figure, and ISO 8601 times."""
    if cls is Figure:
        if not kw["how"].strip():
            raise _SchemaError(
                join_key(key, "how"), "is empty", "say how the figure was measured, or which document it comes from"
            )
        _check_time(kw["when"], join_key(key, "when"), required=True)
    if cls is Profile:
        _check_time(kw.get("created", ""), "created", required=False)


def _check_time(s: str, key: str, *, required: bool) -> None:
    if not s and not required:
        return
    try:
        datetime.fromisoformat(s.replace("Z", "+00:00"))
    except ValueError:
        raise _SchemaError(
            key, f"is {s!r}, not an ISO 8601 date or time", 'write e.g. "2025-01-31" or "2025-01-31T12:00:00+00:00"'
        ) from None


def _required(cls: type) -> list[str]:
    return [
        f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]


# -- writing -------------------------------------------------------------------------------------


def profile_to_dict(p: Any) -> Any:
    """Plain TOML-ready data of a profile (or any part of it): dataclasses become dicts in field
    order, tuples become lists, and None (an absent optional table) is left out."""
    if dataclasses.is_dataclass(p) and not isinstance(p, type):
        return {f.name: profile_to_dict(getattr(p, f.name)) for f in dataclasses.fields(p) if getattr(p, f.name) is not None}
    if isinstance(p, (tuple, list)):
        return [profile_to_dict(x) for x in p]
    return p


def dumps_profile(p: Profile) -> str:
    """TOML text of ``p``: sections as tables, figures and small records as inline tables."""
    d = profile_to_dict(p)
    lines: list[str] = []
    _emit_table(d, "", lines, top=True)
    text = "\n".join(lines).strip("\n") + "\n"
    if tomllib.loads(text) != d:  # the writer is ours; never let it write what reads back differently
        raise AssertionError("profile TOML writer produced text that does not read back as the profile")
    return text


def save_profile(p: Profile, path: str) -> str:
    """Write ``p`` to ``path`` atomically (temporary file, fsync, rename); return the path."""
    text = dumps_profile(p)
    path = os.path.abspath(path)
    d = os.path.dirname(path)
    try:
        os.makedirs(d, exist_ok=True)
        tmp = os.path.join(d, f".{os.path.basename(path)}.tmp-{os.getpid()}")
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)  # the rename itself survives a crash
        finally:
            os.close(fd)
    except OSError as e:
        raise ConfigError(
            f"cannot write profile {path} ({e.strerror}): choose a writable directory with --output or ${PROFILE_DIR_ENV}"
        ) from None
    return path


def _inline_ok(v: Any) -> bool:
    """Whether a value can be written inside an inline table: no arrays of tables below it."""
    if isinstance(v, dict):
        return all(_inline_ok(x) for x in v.values())
    if isinstance(v, list):
        return not any(isinstance(x, dict) for x in v) and all(_inline_ok(x) for x in v)
    return True


def _literal(v: Any) -> str:
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{_key(k)} = {_literal(x)}" for k, x in v.items()) + " }" if v else "{}"
    if isinstance(v, list):
        if any(isinstance(x, dict) for x in v):
            return "[\n" + "".join(f"    {_literal(x)},\n" for x in v) + "]"
        return "[" + ", ".join(_literal(x) for x in v) + "]"
    if type(v) is float and math.isfinite(v) and v and not 1e-3 <= abs(v) < 1e6:
        return _short_float(v)
    return tomli_w.dumps({"v": v})[len("v = ") :].rstrip("\n")


def _short_float(v: float) -> str:
    """Shortest exponent form that reads back exactly: ``1.425e9``, not ``1425000000.0``."""
    for digits in range(17):
        s = f"{v:.{digits}e}"
        if float(s) == v:
            break
    mantissa, exp = s.split("e")
    return f"{mantissa}e{int(exp)}"


def _key(k: str) -> str:
    return tomli_w.dumps({k: 0})[: -len(" = 0\n")]


def _emit_table(d: dict, name: str, out: list[str], *, top: bool = False, element: bool = False) -> None:
    literals, tables, arrays = [], [], []
    for k, v in d.items():
        if isinstance(v, dict) and (top or not _inline_ok(v)):
            tables.append((k, v))
        elif isinstance(v, list) and v and all(isinstance(x, dict) for x in v) and not all(_inline_ok(x) for x in v):
            arrays.append((k, v))
        else:
            literals.append((k, v))
    if name:
        out.append(f"[[{name}]]" if element else f"[{name}]")
    out.extend(f"{_key(k)} = {_literal(v)}" for k, v in literals)
    out.append("")
    for k, v in tables:
        _emit_table(v, join_key(name, _key(k)), out)
    for k, v in arrays:
        for x in v:
            _emit_table(x, join_key(name, _key(k)), out, element=True)
