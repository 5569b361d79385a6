"""TD-Pipe on the real stage runtime: TD-Pipe vs PP+SB vs PP+HB vs engine.LLM, and the simulator's prediction.

Real processes on this machine: the `bench` model split into 2 `pdserve stage`
processes with 1 torch thread each (`tdpipe.runtime.local.run_local_pipeline`),
against plain `engine.LLM` (its `LLMEngine`) in one process with 2 threads — the
same two cores. Workload: ShareGPT-like lengths from `tdpipe.workload.generate`
(inputs <= 1023 tokens; outputs capped at `--max-output`, 256 by default: 37% of
the requests sit at the cap and the median, 180, stays in place, whereas 128
would pile 65% at the cap and flatten the length spread that the policies
schedule around; the cost is ~44k output tokens per run, tens of minutes for the
four runs on 2 cores — `--max-output 128` for a faster run), deterministic random token ids in the
vocabulary, greedy, ignore_eos
(max_tokens = the workload's output length: where each answer ends), seed 0; the same requests for
every run. Every runtime run and the engine get the same KV capacity in tokens.

Output lengths: the policies admit and plan each request on a *predicted* length, the workload's
bucket predictor (`tdpipe.workload`: 55% of predictions in the true length's percentile bucket, as
the paper's predictor, the rest in a neighbouring one), and recompute-preempt when a prediction
was short, as `pdserve batch` does. `--lengths exact` plans on the true lengths instead (a perfect
predictor, which no real job has; the figures this script printed before issue 52).

Simulator check: each stage is profiled alone (`tdpipe.runtime.profile`), the
profile becomes a `CostTable`, and the simulator runs each policy object (`SimExecutor`) on
the same requests with the same predicted lengths. Predicted vs measured
output tok/s per policy; target within ±10%, and the simulated bubble within 3 percentage
points of the measured one (`bubble_error_pp`; the profile also measures the hand-off and
dispatch costs, `tdpipe/overheads.py`). Target for the runtime: TD-Pipe >=
1.3x PP+SB; and TD-Pipe against one `pdserve.engine.LLM` on the same two cores (`llm_ratio`):
on one CPU machine where the whole model fits one process, a single engine has no pipeline bubble
and no hand-off, and can be faster; a pipeline is for a model that does not fit one device.
Bubble: per stage 1 − busy/wall over the job's span, from the
stages' own timelines, averaged over stages.

Throughput is output tokens over the job's span (first batch start to last batch
end over all stages), so process start-up and model loading are left out; the
engine is timed from its first step to its last.

Rounds: every run (engine.LLM and each policy) is repeated `--rounds` times (default 3), the order
reversed on every other round; each figure is the median over the rounds, each ratio the median of
the per-round ratios, and the JSON keeps every round's tok/s (`per_round`). The simulator's
prediction is made once (it is deterministic).

    python -m benchmarks.tdpipe_runtime [--quick] [--rounds N] [--plot timeline.png] [--requests N]
        [--model-size tiny|bench] [--lengths predicted|exact]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time
from pathlib import Path

from benchmarks.common import add_rounds_arg, alternate, emit, median_figures
from benchmarks.tdpipe_runs import BLOCK_SIZE, NUM_STAGES, build_workload, predict, run_llm, run_pipeline
from pdserve.tdpipe.config import InstanceConfig
from pdserve.tdpipe.runtime.profile import build_cost_table, plan_profile
from pdserve.tdpipe.runtime.profile_cache import cached_profiles, default_cache_dir
from pdserve.tdpipe.runtime.timeline import plot_timelines
from pdserve.tdpipe.simulator import CLI_NAMES

POLICIES = {p: CLI_NAMES[p] for p in ("tdpipe", "pp-sb", "pp-hb")} | {
    "tdpipe-overlap": "td-pipe-overlap",
    "tdpipe-whole": "td-pipe-whole-prompts",
    "tdpipe-eager-head": "td-pipe-head-per-batch",
}
"""Runtime (`pdserve batch --policy`) name -> the simulator's name of the same policy object
(`tdpipe-overlap`: the experimental TD-Pipe whose phase switches do not drain, tdpipe/td_overlap.py;
`tdpipe-whole`: TD-Pipe keeping every prompt whole in one prefill batch, as before chunking;
`tdpipe-eager-head`: TD-Pipe sampling each prefill batch's first tokens as it ends, as before
`TDPipeOptions.hold_first_tokens`)."""
LABELS = {
    "tdpipe": "TD-Pipe",
    "tdpipe-overlap": "TD-Pipe (overlapped switches)",
    "tdpipe-whole": "TD-Pipe (whole prompts)",
    "tdpipe-eager-head": "TD-Pipe (head per batch)",
    "pp-sb": "PP+SB",
    "pp-hb": "PP+HB",
    "llm": "pdserve.engine.LLM (1 process)",
}
DEFAULT_POLICIES = "tdpipe,pp-sb,pp-hb"
MAX_BATCH_TOKENS = 2048
"""Token budget of one prefill/hybrid batch (the runtime's and the simulator's default); --quick uses 512."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="16 short requests, 512-token batches, few profile points (< 1 minute on a quiet machine)",
    )
    parser.add_argument(
        "--model-size",
        choices=("tiny", "bench"),
        default=None,
        help="built-in model (default bench; quick: tiny, so that it ends within a minute)",
    )
    parser.add_argument("--requests", type=int, default=None, help="default 256 (quick: 16)")
    parser.add_argument("--max-output", type=int, default=None, help="output length cap (default 256; quick 16)")
    parser.add_argument("--max-input", type=int, default=None, help="input length cap (default 1023; quick 128)")
    parser.add_argument(
        "--max-batch-tokens",
        type=int,
        default=None,
        help=f"prefill batch token budget (default {MAX_BATCH_TOKENS}; quick 512)",
    )
    parser.add_argument(
        "--kv-blocks",
        type=int,
        default=None,
        help=f"KV blocks of {BLOCK_SIZE} tokens per stage = the instance's capacity "
        "(default: room for half of the job's tokens)",
    )
    parser.add_argument(
        "--llm-threads",
        type=int,
        default=2,
        help="torch threads of the pdserve.engine.LLM baseline (2: the same two cores as the stages)",
    )
    parser.add_argument("--skip-llm", action="store_true", help="leave out the pdserve.engine.LLM baseline")
    parser.add_argument(
        "--lengths",
        choices=("predicted", "exact"),
        default="predicted",
        help="what the policies plan each request on: the workload's 55%%-accurate bucket prediction "
        "(default) or its true output length (a perfect predictor)",
    )
    parser.add_argument(
        "--policies",
        default=DEFAULT_POLICIES,
        help=f"comma-separated runtime policies from {sorted(POLICIES)} (default {DEFAULT_POLICIES}; tdpipe and pp-sb "
        "are needed for the ratio)",
    )
    parser.add_argument(
        "--profile-cache",
        default=None,
        help="directory of cached stage profiles (default: pdserve's cache; 'off' profiles afresh)",
    )
    parser.add_argument(
        "--phase-split",
        choices=["on", "off"],
        default="on",
        help="prefill batches on the equal layer split, decode steps on the head-weighted one, for every "
        "policy (pdserve batch --phase-split; default on)",
    )
    add_rounds_arg(parser)
    parser.add_argument("--plot", default=None, help="write a stages x time PNG of every runtime run (first round)")
    parser.add_argument("--dump", default=None, help="write the stages' raw timelines (JSON) of every runtime run")
    args = parser.parse_args()

    from pdserve.engine.builtin import default_model_dir
    from pdserve.engine.kernels import cpu_build
    from pdserve.engine.tokenizer import Tokenizer

    wall0 = time.perf_counter()
    model_dir = default_model_dir(args.model_size or ("tiny" if args.quick else "bench"))
    cpu_build.load_paged_attention_op()  # build the kernel once here; the stage processes then only load it
    num = args.requests or (16 if args.quick else 256)
    max_output = args.max_output or (16 if args.quick else 256)
    max_input = args.max_input or (128 if args.quick else 1023)
    max_batch = args.max_batch_tokens or (512 if args.quick else MAX_BATCH_TOKENS)
    if max_input >= max_batch:
        parser.error("--max-input must be below --max-batch-tokens (a prompt is prefilled whole)")
    vocab = Tokenizer(model_dir).vocab_size
    reqs = build_workload(num, max_input, max_output, vocab, exact_lengths=args.lengths == "exact")
    hits = sum(r.predicted_len == r.output_len for r in reqs)
    job_tokens = sum(len(r.prompt_ids) + r.output_len for r in reqs)
    longest = max(len(r.prompt_ids) + r.output_len for r in reqs)
    # The KV must bind for the policies to differ (the paper's memory-bound regime): room for half
    # of the job's tokens keeps many requests resident, yet no policy can admit the whole job at once.
    kv_blocks = args.kv_blocks or max(-(-job_tokens // 2 // BLOCK_SIZE), -(-2 * longest // BLOCK_SIZE) + 2)
    kv_tokens = kv_blocks * BLOCK_SIZE
    plan = plan_profile(  # on what the job knows of its lengths, as `pdserve batch` plans its profile
        [len(r.prompt_ids) for r in reqs],
        [r.predicted_len for r in reqs],
        kv_tokens=kv_tokens,
        num_stages=NUM_STAGES,
        max_batch_tokens=max_batch,
        quick=args.quick,
    )
    ctx = plan.decode_context
    print(
        f"workload: {num} requests, input mean {sum(len(r.prompt_ids) for r in reqs) / num:.0f} "
        f"(max {max(len(r.prompt_ids) for r in reqs)}), output mean {sum(r.output_len for r in reqs) / num:.0f} "
        f"(cap {max_output}), {sum(r.output_len for r in reqs)} output tokens; KV {kv_blocks} blocks x "
        f"{BLOCK_SIZE} = {kv_tokens} tokens; mean decode context {ctx}; "
        f"planned on {args.lengths} lengths ({hits}/{num} exact)",
        flush=True,
    )

    # 1. profile the stages (forwards, hand-offs, dispatch) and build the simulator's table; cached
    # like `pdserve batch`'s profile, so a rerun reuses it
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if unknown := [p for p in policies if p not in POLICIES]:
        parser.error(f"unknown --policies {unknown}; choose from {sorted(POLICIES)}")
    cache_dir = None if args.profile_cache == "off" else Path(args.profile_cache or default_cache_dir())
    phase_split = args.phase_split == "on"  # the profile and every policy's stages alike
    t0 = time.perf_counter()
    profiles, cached = cached_profiles(
        model_dir,
        NUM_STAGES,
        plan,
        cache_dir,
        block_size=BLOCK_SIZE,
        num_threads=1,
        dtype="auto",
        attention_backend="auto",
        device="cpu",
        repeats=1 if args.quick else 3,
        phase_split=phase_split,
    )
    profile_seconds = time.perf_counter() - t0
    print(f"profile: {'read from ' + str(cached) if cached else 'measured'} in {profile_seconds:.1f}s", flush=True)
    for p in profiles:
        print(
            f"profile stage {p.stage} layers {p.layer_range}: decode@ctx{ctx} "
            + " ".join(f"{b}:{t:.0f}" for b, t in p.decode_ms.items())
            + " ms; prefill "
            + " ".join(f"{n}:{t:.0f}" for n, t in p.prefill_ms.items())
            + " ms",
            flush=True,
        )

    # 2. the simulator's prediction, on the same requests and capacity. The table's decode range is
    # cut at the largest decode batch the policies form (prefills below the cut would be priced
    # as decode steps); the simulator makes the runtime's decisions, so its batches are the
    # runtime's batches and a few rounds find the cut.
    inst = InstanceConfig(
        num_stages=NUM_STAGES, capacity_blocks=kv_blocks, block_size=BLOCK_SIZE, max_batch_tokens=max_batch
    )
    cut = plan.decode_max
    for attempt in range(4):
        table = build_cost_table(profiles, f"{model_dir.name}-2stage-1thread", decode_max=cut)
        sims = {p: predict(POLICIES[p], table, inst, reqs) for p in policies}
        # decode-only batches (PP+HB labels every batch "hybrid"): one new token per item
        biggest = max(
            (len(items) for _, log in sims.values() for _, items in log if all(n == 1 for _, n, _ in items)), default=1
        )
        if biggest == cut or attempt == 3:
            break
        cut = biggest
    predicted = {p: stats for p, (stats, _) in sims.items()}
    print(
        f"overheads {table.overheads.to_dict()}; table: {len(table.tokens)} rows, decode curve up to "
        f"batch {cut} (largest simulated decode batch {biggest}), prefill curve above",
        flush=True,
    )

    # 3. the real runs, alternating over the rounds
    def llm_run() -> dict:
        r = run_llm(model_dir, reqs, kv_blocks, args.llm_threads, max_batch)
        print(f"engine.LLM: {r['tok_s']:.1f} tok/s ({r['seconds']:.1f}s)", flush=True)
        return r

    def pipeline_run(policy: str) -> dict:
        r = run_pipeline(model_dir, reqs, kv_blocks, POLICIES[policy], max_batch, table, phase_split)
        # the runtime and the simulator run one policy object on one table: their decisions must agree,
        # so the prediction error below is the cost model's, not a different schedule's
        r["same_decisions"] = r.pop("decisions") == sims[policy][1]
        print(
            f"{LABELS[policy]}: {r['tok_s']:.1f} tok/s ({r['seconds']:.1f}s), bubble {r['bubble']:.1%}, "
            f"predicted {predicted[policy].throughput:.1f}, {r['batches']} batches, "
            f"decisions == simulator's: {r['same_decisions']}",
            flush=True,
        )
        return r

    arms = {} if args.skip_llm else {"llm": llm_run}
    arms |= {p: functools.partial(pipeline_run, p) for p in policies}
    ran = alternate(arms, args.rounds)
    # medians of the numbers; the timelines (--plot, --dump) are the first round's
    results = {name: median_figures(ran.of(name)) for name in arms}
    same_decisions = {p: results[p]["same_decisions"] for p in policies}  # true only if true in every round

    # 4. report
    sb = results.get("pp-sb", {}).get("tok_s")
    llm = results.get("llm", {}).get("tok_s")
    print(
        f"\n{'policy':32s} {'tok/s':>8s} {'/PP+SB':>7s} {'/LLM':>6s} {'sim tok/s':>9s} {'sim err':>8s} "
        f"{'bubble':>7s} {'sim bub':>7s} {'switch':>6s} {'preempt':>7s} {'max dec b':>9s}"
    )
    errors, bubbles, bubble_errors = {}, {}, {}
    for name, r in results.items():
        sim = predicted.get(name)
        err = (sim.throughput - r["tok_s"]) / r["tok_s"] if sim else None
        if sim:
            errors[name] = round(err, 3)
            bubbles[name] = round(r["bubble"], 3)
            bubble_errors[name] = round(100 * (sim.summary()["bubble_frac"] - r["bubble"]), 1)
        row = [
            f"{LABELS[name]:32s}",
            f"{r['tok_s']:8.1f}",
            f"{r['tok_s'] / sb:7.2f}" if sb else f"{'-':>7s}",
            f"{r['tok_s'] / llm:6.2f}" if llm else f"{'-':>6s}",
            f"{sim.throughput:9.1f}" if sim else f"{'-':>9s}",
            f"{err:+8.1%}" if sim else f"{'-':>8s}",
            f"{r['bubble']:7.1%}" if "bubble" in r else f"{'-':>7s}",
            f"{sim.summary()['bubble_frac']:7.1%}" if sim else f"{'-':>7s}",
            f"{r.get('phase_switches', '-')!s:>6s}",
            f"{r.get('preemptions', '-')!s:>7s}",
            f"{r.get('max_decode_batch', '-')!s:>9s}",
        ]
        print(" ".join(row))
    over = {n: r["max_decode_batch"] for n, r in results.items() if r.get("max_decode_batch", 0) > cut}
    if over:
        print(f"WARNING: decode batches above the table's decode range ({cut}): {over}", flush=True)
    if args.plot:
        plot_timelines(
            {f"{LABELS[n]}, {r['tok_s']:.1f} tok/s": r["timelines"] for n, r in results.items() if "timelines" in r},
            args.plot,
        )
        print(f"wrote {args.plot}", flush=True)
    if args.dump:
        Path(args.dump).write_text(json.dumps({n: r["timelines"] for n, r in results.items() if "timelines" in r}))

    td = results["tdpipe"]["tok_s"] if "tdpipe" in results else None
    sb_ratios = ran.ratios("tdpipe", "pp-sb", "tok_s") if td and sb else []
    llm_ratios = ran.ratios("tdpipe", "llm", "tok_s") if td and llm else []
    if td and llm:
        verdict = "faster than" if td > llm else "slower than"
        print(
            f"TD-Pipe (2 stage processes, 1 thread each) is {verdict} one pdserve.engine.LLM on the same "
            f"{args.llm_threads} threads: {td:.1f} vs {llm:.1f} tok/s ({td / llm:.2f}x)",
            flush=True,
        )
    emit(
        {
            "metric": "tdpipe_output_tok_s",
            "value": round(td, 2) if td else None,
            "baseline": round(sb, 2) if sb else None,
            "ratio": ran.median_ratio("tdpipe", "pp-sb", "tok_s") if sb_ratios else None,
            "ratio_per_round": [round(r, 3) for r in sb_ratios],
            "target": 1.3,
            "unit": "output tok/s of the real 2-stage runtime; baseline PP+SB, target TD-Pipe/PP+SB >= 1.3",
            "llm_baseline": round(llm, 2) if llm else None,
            "llm_ratio": ran.median_ratio("tdpipe", "llm", "tok_s") if llm_ratios else None,
            "llm_ratio_per_round": [round(r, 3) for r in llm_ratios],
            "rounds": args.rounds,
            "per_round": [{n: round(r["tok_s"], 1) for n, r in got.items()} for got in ran.rounds],
            "lengths": args.lengths,
            "predicted_exact": hits,
            "model": model_dir.name,
            "quick": args.quick,
            "requests": num,
            "max_input": max_input,
            "max_output": max_output,
            "output_tokens": sum(r.output_len for r in reqs),
            "kv_blocks": kv_blocks,
            "block_size": BLOCK_SIZE,
            "max_batch_tokens": max_batch,
            "phase_split": args.phase_split,
            "layer_ranges": [list(p.layer_range) for p in profiles],
            "decode_context": ctx,
            "table_decode_max_batch": cut,
            "tok_s": {n: round(r["tok_s"], 1) for n, r in results.items()},
            "vs_llm": {n: round(r["tok_s"] / llm, 3) for n, r in results.items()} if llm else None,
            "sim_tok_s": {n: round(s.throughput, 1) for n, s in predicted.items()},
            "sim_error": errors,
            "sim_target": 0.1,
            "sim_within_target": {n: abs(e) <= 0.1 and abs(bubble_errors[n]) <= 3.0 for n, e in errors.items()},
            "profile_seconds": round(profile_seconds, 2),
            "profile_cached": cached is not None,
            "overheads": table.overheads.to_dict(),
            "bubble": bubbles,
            "bubble_error_pp": bubble_errors,
            "bubble_target_pp": 3.0,
            "sim_bubble": {n: s.summary()["bubble_frac"] for n, s in predicted.items()},
            "phase_switches": {n: r["phase_switches"] for n, r in results.items() if "phase_switches" in r},
            "preemptions": {n: r["preemptions"] for n, r in results.items() if "preemptions" in r},
            "sim_preemptions": {n: s.num_preemptions for n, s in predicted.items()},
            "decisions_match_simulator": same_decisions,
            # libgomp's default spin-wait makes 2-thread steps ~10x slower on an oversubscribed machine
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
            "wall_s": round(time.perf_counter() - wall0, 1),
        }
    )


if __name__ == "__main__":
    main()
