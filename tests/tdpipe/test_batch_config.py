"""`pdserve batch`'s settings: read once from the flags into a frozen BatchConfig that covers every flag."""

from __future__ import annotations

import dataclasses

import pytest

from pdserve.cli import build_parser
from pdserve.tdpipe.runtime.batch_config import RESOLVED, BatchConfig

NOT_JOB_SETTINGS = {"command", "func", "config_file", "device", "attention_backend"}
"""Parser entries the job does not read from its config: the CLI's own, and the device options
(`device_options` resolves them into the device dict the job gets beside its config)."""


def test_every_batch_flag_is_a_config_field_and_every_field_a_flag():
    parsed = vars(build_parser().parse_args(["batch", "-i", "in.jsonl", "-o", "out.jsonl"]))
    fields = {f.name for f in dataclasses.fields(BatchConfig)}
    assert set(parsed) - NOT_JOB_SETTINGS == fields - set(RESOLVED)


def test_the_config_is_frozen_and_resolving_makes_a_copy():
    args = build_parser().parse_args(["batch", "-i", "in.jsonl", "-o", "out.jsonl", "--block-size", "32"])
    args.model, args.stages, args.tensor_parallel_size = "m", 2, 1  # what `pdserve batch` fills in
    config = BatchConfig.from_args(args)
    assert config.block_size == 32 and config.num_kv_blocks is None and config.split_by_phase is False
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.num_kv_blocks = 8  # type: ignore[misc]
    resolved = config.resolved(num_kv_blocks=8, split_by_phase=True)
    assert (resolved.num_kv_blocks, resolved.split_by_phase) == (8, True)
    assert (config.num_kv_blocks, config.split_by_phase) == (None, False)
