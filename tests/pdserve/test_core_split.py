"""`pdserve up --num-threads auto|N`: the flag, and the split of the cores between node processes."""

from __future__ import annotations

import argparse

import pytest

from pdserve.cli import build_parser
from pdserve.commands.core_split import Share, describe, node_shares, num_threads_arg, sharing_note, split_cores

ONE_P_TWO_D = [("prefill", 1), ("decode", 1), ("decode", 1)]


def test_the_flag_takes_auto_or_a_positive_count(capsys):
    assert num_threads_arg("auto") is None and num_threads_arg("3") == 3
    for bad in ("0", "-2", "two", "1.5", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="auto"):
            num_threads_arg(bad)
    parser = build_parser()
    assert parser.parse_args(["up"]).num_threads is None  # auto is the default
    assert parser.parse_args(["up", "--num-threads", "2"]).num_threads == 2
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["up", "--num-threads", "0"])
    assert e.value.code == 2 and "--num-threads" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("cores", "threads"),
    [(1, [1, 1, 1]), (2, [1, 1, 1]), (3, [1, 1, 1]), (4, [2, 1, 1]), (5, [3, 1, 1]), (8, [4, 2, 2]), (16, [8, 4, 4])],
)
def test_prefill_weighs_twice_a_decode_node_and_threads_never_exceed_cores(cores, threads):
    shares = split_cores(list(range(cores)), ONE_P_TWO_D)
    assert [s.threads for s in shares] == threads
    if cores < len(ONE_P_TWO_D):  # no split exists: one thread each, the kernel balances them
        assert all(s.cpus is None for s in shares)
        return
    assert sum(s.threads for s in shares) <= cores
    sets = [s.cpus for s in shares]
    assert all(s and len(s) == s_.threads for s, s_ in zip(sets, shares))
    assert len(frozenset().union(*sets)) == sum(len(s) for s in sets)  # disjoint: no core shared


def test_the_split_uses_the_cpus_given_and_counts_tensor_parallel_ranks():
    # the usable CPUs need not start at 0 nor be contiguous (a container's cpuset)
    shares = split_cores([9, 3, 5, 7], [("prefill", 1), ("decode", 1)])
    assert shares == [Share(3, frozenset({3, 5, 7})), Share(1, frozenset({9}))]
    # a TP-2 prefill node needs two cores before anyone gets a second; its threads are per rank
    shares = split_cores(list(range(8)), [("prefill", 2), ("decode", 1)])
    assert [s.threads for s in shares] == [3, 2] and [len(s.cpus or ()) for s in shares] == [6, 2]
    assert split_cores(list(range(2)), [("prefill", 2), ("decode", 1)]) == [Share(1, None)] * 2
    assert split_cores([0, 1], []) == []
    assert split_cores([0], [("decode", 1)]) == [Share(1, frozenset({0}))]


def test_a_number_overrides_auto_and_pins_nothing():
    assert node_shares(3, ONE_P_TWO_D) == [Share(3, None)] * 3
    auto = node_shares(None, ONE_P_TWO_D)
    assert len(auto) == 3 and sum(s.threads for s in auto) >= 3


def test_describe_names_each_nodes_threads_and_cpus():
    shares = [Share(2, frozenset({0, 1})), Share(1, frozenset({4})), Share(1, None), Share(2, frozenset({5, 7}))]
    text = describe(["prefill", "decode", "decode", "decode"], shares)
    assert text == "prefill 2 (CPUs 0-1), decode 1 (CPU 4), decode 1 (unpinned), decode 2 (CPUs [5, 7])"


def test_up_notes_nodes_that_share_the_cores_and_only_then():
    shared = split_cores([0, 1], ONE_P_TWO_D)
    note = sharing_note(shared, 2)
    assert note is not None and note.startswith("3 nodes share 2 cores") and "pdserve plan --cores 2" in note
    assert sharing_note(split_cores([0, 1, 2, 3], ONE_P_TWO_D), 4) is None
    assert sharing_note([], 2) is None
