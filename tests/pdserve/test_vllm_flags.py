"""vLLM's serving flags on every command that takes them (parsed, and turned into the process's config),
and `up` handing each to the children that use it with the same meaning."""

from __future__ import annotations

import pytest

from pdserve.engine.config import EngineConfig
from pdserve.cli import build_parser
from pdserve.commands.node_common import node_config
from pdserve.commands.router import router_config
from pdserve.commands.serving_args import NODE_FLAGS, ROUTER_FLAGS, child_flags, load_frontend

MODEL_COMMANDS = ("generate", "prefill", "decode", "router", "up")
NODES = ("prefill", "decode")


def parse(argv: list[str]):
    return build_parser().parse_args(argv)


@pytest.mark.parametrize("command", MODEL_COMMANDS)
@pytest.mark.parametrize("alias, dtype", [("half", "float16"), ("float", "float32"), ("bfloat16", "bfloat16")])
def test_dtype_aliases_on_every_model_command(command, alias, dtype):
    assert parse([command, "--dtype", alias]).dtype == dtype
    assert EngineConfig(model_dir="m", dtype=alias).dtype == dtype  # the Python API takes them too


@pytest.mark.parametrize("command", MODEL_COMMANDS)
def test_a_bad_dtype_exits_2(command, capsys):
    with pytest.raises(SystemExit) as e:
        parse([command, "--dtype", "float8"])
    assert e.value.code == 2 and "--dtype" in capsys.readouterr().err


@pytest.mark.parametrize("command", ("router", "up", *NODES))
def test_several_served_names(command):
    assert parse([command, "--served-model-name", "a", "b/c"]).served_model_name == ["a", "b/c"]


@pytest.mark.parametrize("role", NODES)
def test_node_flags_reach_the_node_config(role):
    argv = [role, "--max-num-seqs", "9", "--max-num-batched-tokens", "300", "--seed", "4", "--max-model-len", "50"]
    config = node_config(parse(argv + ["--served-model-name", "x", "y", "--tokenizer", "/t", "--dtype", "half"]), role)
    e = config.engine
    assert (e.max_num_seqs, e.max_num_batched_tokens, e.seed, e.max_model_len) == (9, 300, 4, 50)
    assert (e.tokenizer, e.dtype, config.node.served_model_name) == ("/t", "float16", ("x", "y"))


@pytest.mark.parametrize("role", NODES)
def test_max_num_seqs_defaults_to_vllms_256(role):
    assert node_config(parse([role]), role).engine.max_num_seqs == 256 == EngineConfig(model_dir="m").max_num_seqs


def test_router_flags_reach_the_router_config(tmp_path):
    argv = ["router", "--served-model-name", "a", "b", "--tokenizer", "/t", "--chat-template", "{{ 1 }}"]
    argv += ["--generation-config", "vllm", "--no-enable-prompt-tokens-details", "--max-model-len", "64"]
    c = router_config(parse(argv))
    assert (c.served_model_name, c.tokenizer, c.chat_template) == (("a", "b"), "/t", "{{ 1 }}")
    assert (c.generation_config, c.enable_prompt_tokens_details, c.max_model_len) == ("vllm", False, 64)
    d = router_config(parse(["router"]))
    assert (d.served_model_name, d.generation_config, d.enable_prompt_tokens_details) == ((), "auto", True)
    with pytest.raises(SystemExit, match="max-model-len"):
        router_config(parse(["router", "--max-model-len", "1"]))


def test_router_refuses_a_bad_template_or_generation_config_at_start(tiny_model_dir, tmp_path):
    base = ["router", "--model", str(tiny_model_dir)]
    with pytest.raises(SystemExit, match="does not compile"):
        load_frontend(router_config(parse(base + ["--chat-template", "{% if %}"])))
    with pytest.raises(SystemExit, match="no generation_config.json"):
        load_frontend(router_config(parse(base + ["--generation-config", str(tmp_path)])))
    tokenizer, defaults = load_frontend(router_config(parse(base + ["--chat-template", "X{{ messages | length }}"])))
    assert tokenizer.apply_chat_template([{"role": "user", "content": "q"}]) == "X1" and defaults == {}


def test_up_hands_each_flag_to_the_children_that_use_it():
    """What `up` passes parses in the child to the same values (router: its own; nodes: theirs)."""
    up = parse(
        [
            "up",
            "--served-model-name",
            "a",
            "b",
            "--tokenizer",
            "/t",
            "--chat-template",
            "T{{ 1 }}",
            "--generation-config",
            "vllm",
            "--no-enable-prompt-tokens-details",
            "--max-num-seqs",
            "7",
            "--max-num-batched-tokens",
            "99",
            "--seed",
            "5",
            "--max-model-len",
            "80",
        ]  # fmt: skip
    )
    router = parse(["router", *child_flags(up, ROUTER_FLAGS)])
    for dest in ROUTER_FLAGS:
        assert getattr(router, dest) == getattr(up, dest), dest
    for role in NODES:
        from pdserve.commands.memory_args import kv_memory_flags

        node = parse([role, *child_flags(up, NODE_FLAGS), *kv_memory_flags(up)])
        for dest in NODE_FLAGS + ("max_model_len",):
            assert getattr(node, dest) == getattr(up, dest), (role, dest)
    assert child_flags(parse(["up"]), ROUTER_FLAGS + NODE_FLAGS) == []  # unset: the children's defaults
    assert parse(["up", "--enable-prompt-tokens-details"]).enable_prompt_tokens_details is True


@pytest.mark.parametrize("command", ("router", "up"))
def test_disable_log_requests_is_accepted(command):
    assert parse([command, "--disable-log-requests"]).disable_log_requests is True
