"""Each engine option is one field of flashvlm/config.py, and every place that offers the options follows from it:
the flags of `flashvlm generate | serve | bench | eval`, `LLM`'s keywords and the table in docs/engine.md. Values the
engine derives at start-up live in `Engine.limits`, never in the validated config."""

from __future__ import annotations

import argparse
import copy
import dataclasses
from pathlib import Path
from typing import Any

import pytest

import flashvlm.llm as llm_module
from flashvlm.cli import build_parser
from flashvlm.config import (
    CacheConfig,
    ConfigError,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    UnknownOptionError,
    engine_options,
)
from flashvlm.option_spec import EngineOption
from flashvlm.options import TABLE_BEGIN, cli_options, engine_config_from_args, value_type, with_options_table

DOCS = Path(__file__).resolve().parents[2] / "docs" / "engine.md"
SECTIONS = {"model", "cache", "scheduler"}


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    found: dict[str, argparse.ArgumentParser] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            found.update(action.choices)
    return found


def _engine_commands() -> dict[str, tuple[argparse.ArgumentParser, list[str]]]:
    """Every command that takes the engine flags: its parser and the argv prefix that selects it."""
    commands = _subparsers(build_parser())
    bench = _subparsers(commands["bench"])
    found = {name: (commands[name], [name]) for name in ("generate", "serve", "eval")}
    for scenario in ("latency", "throughput", "multiturn", "sweep"):
        found[f"bench {scenario}"] = (bench[scenario], ["bench", scenario])
    return found


def _required_args(command: str) -> list[str]:
    return {"generate": ["hello"], "bench sweep": ["--configs", "[{}]"]}.get(command, [])


def _other_value(opt: EngineOption) -> Any:
    """A value for the option other than its default (not necessarily one the engine accepts)."""
    kind = value_type(opt)
    if opt.spec.choices:
        return next(c for c in reversed(opt.spec.choices) if c != opt.default)
    if kind is bool:
        return not opt.default
    if kind is int:
        return (opt.default or 0) + 3
    if kind is float:
        return opt.default / 2
    if kind is dict:
        return {"gold": 2}
    return "cuda:1" if opt.name == "device" else "/some/checkpoint"


def _as_argv(opt: EngineOption, value: Any) -> list[str]:
    if value_type(opt) is bool:
        return [opt.flag if value else f"--no-{opt.flag[2:]}"]
    return [opt.flag, str(value)]


def _field_value(config: EngineConfig, opt: EngineOption) -> Any:
    return getattr(config if opt.section is None else getattr(config, opt.section), opt.name)


def test_each_option_is_exactly_one_field() -> None:
    names = [opt.name for opt in engine_options()]
    assert len(names) == len(set(names)), "an option name is declared in two sections"
    fields = [f.name for cls in (ModelConfig, CacheConfig, SchedulerConfig) for f in dataclasses.fields(cls)]
    fields += [f.name for f in dataclasses.fields(EngineConfig) if f.name not in SECTIONS]
    assert sorted(fields) == sorted(names)  # every field is an option, declared with option()
    assert all(opt.spec.help.strip() for opt in engine_options())


def test_derived_values_are_not_config_fields() -> None:
    assert "max_model_len" not in {f.name for f in dataclasses.fields(SchedulerConfig)}
    assert "lookahead_slots" not in {f.name for f in dataclasses.fields(SchedulerConfig)}
    assert "num_blocks" not in {f.name for f in dataclasses.fields(CacheConfig)}


@pytest.mark.parametrize("command", list(_engine_commands()))
def test_every_command_has_every_flag_as_declared(command: str) -> None:
    parser, _ = _engine_commands()[command]
    by_dest = {a.dest: a for a in parser._actions}
    for opt in engine_options():
        if not opt.spec.cli:
            assert opt.name not in by_dest, f"{opt.name} is an LLM keyword only"
            continue
        action = by_dest.get(opt.name)
        assert action is not None, f"{command} lacks {opt.flag}"
        assert opt.flag in action.option_strings
        assert action.default == opt.default, opt.name
        assert (action.choices or None) == (list(opt.spec.choices) or None), opt.name
        assert opt.spec.help.replace("%", "%%") in action.help, opt.name
    parser.format_help()  # every help string formats


@pytest.mark.parametrize("command", list(_engine_commands()))
def test_flags_reach_the_engine_config(command: str) -> None:
    """No flags: the config LLM's defaults make. Each flag set to another value: that value in its field."""
    parser, prefix = _engine_commands()[command]
    root = build_parser()
    required = _required_args(command)
    defaults = engine_config_from_args(root.parse_args([*prefix, *required]))
    assert defaults == EngineConfig.from_options()
    argv = []
    for opt in cli_options():
        argv += _as_argv(opt, _other_value(opt))
    config = engine_config_from_args(root.parse_args([*prefix, *required, *argv]))
    for opt in cli_options():
        assert _field_value(config, opt) == _other_value(opt), opt.name


class _NoEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config


def test_llm_takes_every_option_as_a_keyword(monkeypatch) -> None:
    monkeypatch.setattr(llm_module, "Engine", _NoEngine)
    for opt in engine_options():
        if opt.name == "model":
            continue
        llm = llm_module.LLM("/some/checkpoint", **{opt.name: _other_value(opt)})
        assert _field_value(llm.engine.config, opt) == _other_value(opt), opt.name
        assert llm.engine.config.model.model == "/some/checkpoint"
    assert llm_module.LLM("/some/checkpoint").engine.config == EngineConfig(ModelConfig("/some/checkpoint"))


def test_an_unknown_keyword_names_the_closest_options(monkeypatch) -> None:
    monkeypatch.setattr(llm_module, "Engine", _NoEngine)
    with pytest.raises(UnknownOptionError, match="'max_num_seq'; did you mean max_num_seqs"):
        llm_module.LLM("/x", max_num_seq=4)
    with pytest.raises(TypeError, match="unknown engine option 'frobnicate'$"):
        llm_module.LLM("/x", frobnicate=True)


def test_the_docs_table_is_the_fields() -> None:
    page = DOCS.read_text()
    assert TABLE_BEGIN in page
    assert with_options_table(page) == page, "docs/engine.md's options table is stale: python -m flashvlm.options"
    for opt in engine_options():
        assert f"| `{opt.name}` | " in page


@pytest.mark.parametrize("options,message", [
    ({"block_size": 12}, "block_size must be a power of two, got 12"),
    ({"kv_cache_tokens": 8}, r"kv_cache_tokens must be >= block_size \(16\), got 8"),
    ({"gpu_memory_utilization": 1.5}, r"gpu_memory_utilization must be in \(0, 1\], got 1.5"),
    ({"max_num_seqs": 0}, "max_num_seqs must be >= 1, got 0"),
    ({"max_num_batched_tokens": 2.5}, "max_num_batched_tokens must be an integer >= 1, got 2.5"),
    ({"max_model_len": 0}, "max_model_len must be >= 1, got 0"),
    ({"encoder_cache_tokens": -1}, "encoder_cache_tokens must be >= 0, got -1"),
    ({"dtype": "int8"}, "dtype must be auto, float32, float16 or bfloat16, got 'int8'"),
    ({"attention_backend": "flash"}, "attention_backend must be auto, reference, triton or fa4, got 'flash'"),
    ({"device": "tpu"}, "device must be 'cpu', 'cuda' or 'cuda:N', got 'tpu'"),
    ({"max_running_per_group": {"gold": 0}}, r"max_running_per_group\['gold'\] must be a positive integer, got 0"),
])
def test_validation_names_the_option(options: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        EngineConfig.from_options("/x", **options).validate()


def test_engine_derives_limits_without_touching_the_config(tmp_path) -> None:
    from flashvlm.engine.engine import Engine
    from flashvlm.testing.tiny_checkpoints import build_qwen2_vl

    config = EngineConfig.from_options(str(build_qwen2_vl(tmp_path / "m", seed=3)), device="cpu",
                                       kv_cache_tokens=512, max_model_len=200)
    validated = copy.deepcopy(config).validate()
    engine = Engine(config)
    assert engine.config == validated
    assert engine.limits.max_model_len == engine.max_model_len == engine.scheduler.max_model_len == 200
    assert engine.limits.num_kv_blocks == 512 // 16 + 1 == engine.scheduler.block_manager.num_blocks
    assert engine.limits.lookahead_slots == engine.scheduler.lookahead_slots == 0  # no decode graphs on CPU
    with pytest.raises(dataclasses.FrozenInstanceError):
        engine.limits.max_model_len = 1  # type: ignore[misc]
