"""Knob text (``prefetch_depth``, ``io_concurrency[PATH]``) has one owner, ``engine.config.KnobKey``
(issue 48, item 5): it reads back what it writes, the wire and the CLI find it with its one
pattern, and the engine's pins are written and read through it."""

from __future__ import annotations

import re

import pytest

from engine.config import KnobKey, Knobs, split_key
from engine.errors import ConfigError


@pytest.mark.parametrize(
    "key",
    [
        KnobKey("prefetch_depth"),
        KnobKey("stripe_weights"),
        KnobKey("io_concurrency"),
        KnobKey("io_concurrency", "/mnt/nvme0"),
        KnobKey("io_concurrency", "/x=y:z"),
        KnobKey("io_concurrency", "/odd]name[dir"),
    ],
)
def test_a_knob_key_reads_back_what_it_writes(key):
    text = str(key)
    assert KnobKey.parse(text) == key
    assert split_key(text) == (key.name, key.path)
    assert re.fullmatch(KnobKey.pattern(), text)


def test_a_knob_key_refuses_what_no_knob_is_in_words_naming_the_text():
    with pytest.raises(ConfigError, match=r"unknown knob 'prefech_depth' \(did you mean prefetch_depth\?\)"):
        KnobKey.parse("prefech_depth")
    with pytest.raises(ConfigError, match=r"only io_concurrency takes a \[PATH\]; give stripe_weights as a whole"):
        KnobKey.parse("stripe_weights[/a]")
    with pytest.raises(ConfigError, match="names a path this run does not use"):
        KnobKey.parse("io_concurrency[/b]", ["/a"])
    assert KnobKey.parse("io_concurrency[/a]", ["/a"]).path == "/a"


def test_a_knob_keys_value_is_its_paths_entry_or_the_whole_knob():
    knobs = Knobs(prefetch_depth=3, io_concurrency={"/a": 8})
    assert KnobKey("prefetch_depth").value_in(knobs) == 3
    assert KnobKey("io_concurrency", "/a").value_in(knobs) == 8
    assert KnobKey("io_concurrency", "/b").value_in(knobs) == Knobs.DEFAULT_IO_CONCURRENCY
    assert KnobKey("io_concurrency").value_in(knobs) == {"/a": 8}


def test_the_wire_and_the_cli_read_knob_text_with_the_one_pattern():
    """The pin message's check and ``tune --pin`` take the same knob texts, and either hands on
    text that KnobKey parses."""
    from offloadctl.commands.tune import parse_pin, parse_unpin
    from tuner.protocol import KNOB, ProtocolError

    for text in ("prefetch_depth", "io_concurrency[/x=y:z]", "io_concurrency[/odd]name]", "stripe_weights[/p]"):
        assert KNOB(text, "knob") == text
        assert parse_pin(f"run:a:{text}=8")[:2] == ("run:a", text)
        assert parse_unpin(f"run:a:{text}") == ("run:a", text)
    for text in ("prefech_depth", "io_concurrency[]", "io_concurrency/a", "[/a]"):
        with pytest.raises(ProtocolError, match="knob must be"):
            KNOB(text, "knob")
        with pytest.raises(ConfigError):
            parse_pin(f"run:{text}=8")


def test_the_engines_pins_in_force_are_read_as_knob_keys():
    from engine.facts import pins_in_force

    knobs = Knobs(prefetch_depth=1, io_concurrency={"/a": 2, "/b": 16})
    pins = {"prefetch_depth": 2, "io_concurrency[/a]": 8, "io_concurrency": {"/b": 4}}
    assert pins_in_force(pins, knobs) == {"prefetch_depth": 1, "io_concurrency[/a]": 2, "io_concurrency": {"/a": 2, "/b": 16}}
    with pytest.raises(ConfigError, match="unknown knob 'prefech_depth'"):
        pins_in_force({"prefech_depth": 1}, knobs)
