"""How an engine option is declared: one dataclass field whose metadata (an `Option`) carries its help text, its
allowed values and its check. `flashvlm/config.py` declares every option this way; the CLI flags, `LLM`'s
keywords and the options table of docs/engine.md are read from those fields (`flashvlm/options.py`)."""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable
from dataclasses import MISSING, dataclass
from typing import Any

_KEY = "flashvlm_option"

Check = Callable[[str, Any], "str | None"]
"""(option name, value) -> what is wrong with the value, or None."""


@dataclass(frozen=True)
class Option:
    help: str
    """What the option does: the `--help` text, the docs table's meaning column."""
    choices: tuple[str, ...] = ()
    minimum: int | None = None
    """For integer options: the smallest value allowed (and the value must be an integer)."""
    check: Check | None = None
    """A rule beyond choices and minimum (a power of two, a fraction, a dict of caps). For a value outside the
    choices, its message (where it gives one) says why that value is refused instead of listing the choices."""
    nullable: bool = False
    """None is a valid value (options whose default is None: computed at start-up)."""
    cli: bool = True
    """False: an `LLM` keyword only, no flag (dicts the server fills from its SLA tier file)."""
    shown_default: str | None = None
    """How --help and the docs name a default that is computed at start-up; None: the default value itself."""

    def problem(self, name: str, value: Any) -> str | None:
        """What is wrong with `value` for the option `name`, or None when it is valid."""
        if value is None and self.nullable:
            return None
        if self.choices and value not in self.choices:
            refusal = self.check(name, value) if self.check is not None else None
            return refusal or f"{name} must be {either(self.choices)}, got {value!r}"
        if self.minimum is not None:
            if isinstance(value, bool) or not isinstance(value, int):
                return f"{name} must be an integer >= {self.minimum}, got {value!r}"
            if value < self.minimum:
                return f"{name} must be >= {self.minimum}, got {value}"
        return self.check(name, value) if self.check is not None else None


def option(default: Any = MISSING, *, help: str, choices: tuple[str, ...] = (), minimum: int | None = None,
           check: Check | None = None, cli: bool = True, shown_default: str | None = None,
           default_factory: Callable[[], Any] | Any = MISSING) -> Any:
    """A dataclass field that is an engine option (see `Option` for the arguments)."""
    spec = Option(help=help, choices=choices, minimum=minimum, check=check, nullable=default is None, cli=cli,
                  shown_default=shown_default)
    metadata = {_KEY: spec}
    if default_factory is not MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def either(values: tuple[str, ...]) -> str:
    """'a, b or c'."""
    return values[0] if len(values) == 1 else f"{', '.join(values[:-1])} or {values[-1]}"


@dataclass(frozen=True)
class EngineOption:
    """One option as found on the config dataclasses: where it lives and how it is declared."""

    name: str
    section: str | None
    """The attribute of the top config holding it (model, cache, scheduler); None: the top config itself."""
    field: dataclasses.Field
    spec: Option
    type: Any
    """The field's annotation, resolved (int, int | None, bool, str, dict[str, int], ...)."""

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def required(self) -> bool:
        return self.field.default is MISSING and self.field.default_factory is MISSING

    @property
    def default(self) -> Any:
        """The field's default (None for a required one: the caller supplies it)."""
        if self.field.default_factory is not MISSING:
            return self.field.default_factory()
        return None if self.field.default is MISSING else self.field.default


def collect_options(config_cls: type) -> list[EngineOption]:
    """Every option of `config_cls`, in field order, descending one level into fields that hold a config
    dataclass (the sections). A field that is neither an option nor a section is a declaration error."""
    found: list[EngineOption] = []
    hints = typing.get_type_hints(config_cls)
    for f in dataclasses.fields(config_cls):
        if _KEY in f.metadata:
            found.append(EngineOption(f.name, None, f, f.metadata[_KEY], hints[f.name]))
        elif dataclasses.is_dataclass(hints[f.name]):
            section_hints = typing.get_type_hints(hints[f.name])
            for sub in dataclasses.fields(hints[f.name]):
                if _KEY not in sub.metadata:
                    raise TypeError(f"{hints[f.name].__name__}.{sub.name} is not declared with option()")
                found.append(EngineOption(sub.name, f.name, sub, sub.metadata[_KEY], section_hints[sub.name]))
        else:
            raise TypeError(f"{config_cls.__name__}.{f.name} is neither an option nor a config section")
    return found
