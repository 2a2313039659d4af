"""Agent replay: re-prefilled tokens and TTFT per turn under three snapshot strategies (DESIGN §2).

Scripted coding-agent sessions (tests/agent_sessions.py) in the three context-editing styles
(OpenCode compaction, OpenClaw dropped thinking, SWE-agent last-n observations) are rendered
through the model's chat template turn by turn and served by one engine per strategy:

  none         prefix cache on, no recurrent snapshots (a hybrid model then reuses nothing)
  interval:64  a snapshot every 64 tokens
  anchors      snapshots at the family's semantic anchors (and at each prompt's end)

All strategies get the SAME snapshot budget, given as a number of snapshots of this model, small
enough to bind. Every turn greedily generates a few tokens; the outputs must be identical across
strategies (fp32). Prints per style and strategy: re-prefilled tokens per turn (mean, worst, total)
and TTFT per turn (mean, worst).

    .venv/bin/python tests/bench/bench_agent_replay.py                 # built-in model, fp32
    .venv/bin/python tests/bench/bench_agent_replay.py --model tiny    # seconds: policy checks
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

_TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_TESTS))

import torch  # noqa: E402
from agent_sessions import STYLES, TOOLS, AgentSession, make_session  # noqa: E402

from freetokend import LLM  # noqa: E402
from freetokend.engine.sampler import SamplingParams  # noqa: E402
from freetokend.models.builtin import ensure_builtin_model  # noqa: E402

STRATEGIES = ("none", "interval:64", "anchors")


@dataclass
class TurnResult:
    prompt: int
    cached: int
    ttft_s: float
    output: list[int]
    ttft_cpu_s: float = 0.0  # process CPU time to the first token: robust on a shared machine

    @property
    def prefilled(self) -> int:
        return self.prompt - self.cached


@dataclass
class Run:
    strategy: str
    turns: dict[str, list[TurnResult]] = field(default_factory=dict)
    snapshots_saved: int = 0
    snapshots_restored: int = 0


def model_dir(kind: str, root: Path) -> Path:
    """builtin: the built-in model; tiny: a 64-wide random Qwen3.5-MoE sharing its tokenizer."""
    builtin = ensure_builtin_model(root / "state")
    if kind == "builtin":
        return builtin
    if kind != "tiny":
        return Path(kind)
    from tiny_models import make_tiny

    out = root / "tiny-qwen35moe-416"
    if not (out / "config.json").exists():
        make_tiny("qwen3_5_moe", out, seed=5, vocab_size=416, max_position_embeddings=16384)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(builtin / name, out / name)
    return out


def serve_turn(llm: LLM, rid: str, ids: list[int], gen: int) -> TurnResult:
    """One request through the engine: TTFT is add_request -> first sampled token."""
    eng = llm.engine
    before = eng.stats().prompt_tokens_cached_total
    t0, c0 = time.perf_counter(), time.process_time()
    eng.add_request(rid, ids, SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True))
    out: list[int] = []
    ttft = cpu = 0.0
    while eng.has_unfinished():
        for o in eng.step():
            if not out:
                ttft, cpu = time.perf_counter() - t0, time.process_time() - c0
            out.append(o.token_id)
    return TurnResult(len(ids), eng.stats().prompt_tokens_cached_total - before, ttft, out, cpu)


def replay(
    path: Path, strategy: str, sessions: dict[str, AgentSession], args: argparse.Namespace
) -> Run:
    probe = LLM(path, max_model_len=args.max_len, kv_tokens=64, dtype="float32", prefix_cache=False)
    state = probe.runner.new_state().recurrent
    snap_bytes = state.nbytes if state is not None else 0
    del probe
    llm = LLM(
        path,
        max_model_len=args.max_len,
        kv_tokens=args.kv_tokens,
        dtype="float32",
        snapshot_policy=strategy,
        snapshot_budget_mb=args.budget * snap_bytes / 2**20,
        max_step_tokens=args.step_tokens,
    )
    if llm.engine.prefix is not None and llm.engine.prefix.snapshots is not None:
        llm.engine.prefix.snapshots.retention = args.retention  # "lru": the plain baseline store
    run = Run(strategy, {s: [] for s in sessions})
    order = (
        [(t, s) for t in range(args.turns + 1) for s in sessions]
        if args.interleave
        else [(t, s) for s in sessions for t in range(args.turns + 1)]
    )
    for t, style in order:
        text = llm.chat_template.render(
            sessions[style].messages(t), tools=TOOLS, add_generation_prompt=True
        )
        ids = llm.tokenizer.encode(text)
        run.turns[style].append(serve_turn(llm, f"{style}-{t}", ids, args.gen))
    if llm.engine.prefix is not None and llm.engine.prefix.snapshots is not None:
        run.snapshots_saved = llm.engine.prefix.snapshots.saved
        run.snapshots_restored = llm.engine.prefix.snapshots.restored
    return run


def report(runs: list[Run], styles: list[str]) -> bool:
    """Prints the table; returns whether outputs are identical across strategies."""
    print(
        f"{'style':10} {'strategy':12} {'prompt tok':>10} {'re-prefill mean':>15} {'worst':>6} "
        f"{'total':>7} {'TTFT mean s':>11} {'worst s':>8} {'CPU mean s':>10} {'worst s':>8}"
    )
    for style in styles:
        for run in runs:
            turns = run.turns[style][1:]  # turn 0 has nothing to reuse in any strategy
            pre = [r.prefilled for r in turns]
            ttft = [r.ttft_s for r in turns]
            cpu = [r.ttft_cpu_s for r in turns]
            print(
                f"{style:10} {run.strategy:12} {sum(r.prompt for r in turns):10d} "
                f"{statistics.mean(pre):15.1f} {max(pre):6d} {sum(pre):7d} "
                f"{statistics.mean(ttft):11.3f} {max(ttft):8.3f} {statistics.mean(cpu):10.3f} {max(cpu):8.3f}"
            )
    for run in runs:
        print(
            f"{run.strategy:12} snapshots saved {run.snapshots_saved}, restored {run.snapshots_restored}"
        )
    same = all(
        [r.output for r in run.turns[s]] == [r.output for r in runs[0].turns[s]]
        for run in runs
        for s in styles
    )
    print("greedy outputs identical across strategies:", same)
    return same


def restart_cost(
    path: Path, sessions: dict[str, AgentSession], args: argparse.Namespace, root: Path
) -> None:
    """Per session: engine A (anchors, the same snapshot budget, spilling to a fresh state dir)
    serves turns 0..T-1 and closes (spill); a NEW engine B on that state dir and a cold engine C
    serve turn T. Prints spill size and time, re-prefilled tokens and TTFT of that first turn."""
    kw = dict(
        max_model_len=args.max_len,
        kv_tokens=args.kv_tokens,
        dtype="float32",
        max_step_tokens=args.step_tokens,
    )
    probe = LLM(path, prefix_cache=False, **kw).runner.new_state().recurrent
    budget = args.budget * (probe.nbytes if probe is not None else 0) / 2**20
    c = LLM(path, prefix_cache=False, **kw)
    print(
        f"\n{'restart':10} {'spilled':>7} {'MiB':>6} {'spill s':>7} {'prompt':>7} {'re-prefill warm':>15} "
        f"{'cold':>6} {'TTFT warm s':>11} {'cold s':>7} {'CPU warm s':>10} {'cold s':>7}"
    )
    for style, session in sessions.items():
        state = root / f"restart-{style}"
        shutil.rmtree(state, ignore_errors=True)

        def prompt(llm: LLM, t: int, session: AgentSession = session) -> list[int]:
            text = llm.chat_template.render(
                session.messages(t), tools=TOOLS, add_generation_prompt=True
            )
            return llm.tokenizer.encode(text)

        a = LLM(path, state_dir=state, snapshot_budget_mb=budget, **kw)
        for t in range(args.turns):
            serve_turn(a, f"a-{style}-{t}", prompt(a, t), args.gen)
        t0 = time.perf_counter()
        report = a.close()
        spill_s = time.perf_counter() - t0
        del a
        b = LLM(path, state_dir=state, snapshot_budget_mb=budget, **kw)
        p = prompt(b, args.turns)
        warm = serve_turn(b, f"b-{style}", p, args.gen)
        cold = serve_turn(c, f"c-{style}", p, args.gen)
        b.close()
        assert warm.output == cold.output, f"{style}: output after restart differs"
        print(
            f"{style:10} {report.files:7d} {report.bytes / 2**20:6.1f} {spill_s:7.3f} {len(p):7d} "
            f"{warm.prefilled:15d} {cold.prefilled:6d} {warm.ttft_s:11.3f} {cold.ttft_s:7.3f} "
            f"{warm.ttft_cpu_s:10.3f} {cold.ttft_cpu_s:7.3f}"
        )


def per_turn(runs: list[Run], styles: list[str]) -> None:
    for style in styles:
        print(f"\n{style}: re-prefilled tokens per turn (prompt length first)")
        print("prompt  " + " ".join(f"{r.prompt:5d}" for r in runs[0].turns[style]))
        for run in runs:
            print(
                f"{run.strategy[:7]:7} " + " ".join(f"{r.prefilled:5d}" for r in run.turns[style])
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="builtin", help="builtin | tiny | a checkpoint folder")
    ap.add_argument("--turns", type=int, default=12)
    ap.add_argument("--lines", type=int, default=24, help="mean lines of a tool output")
    ap.add_argument("--keep", type=int, default=3, help="observations / thinking blocks kept")
    ap.add_argument("--every", type=int, default=4, help="OpenCode: compaction period in turns")
    ap.add_argument("--gen", type=int, default=4, help="tokens generated per turn")
    ap.add_argument("--budget", type=float, default=4, help="snapshot budget, in snapshots")
    ap.add_argument("--styles", default=",".join(STYLES))
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument(
        "--interleave", action="store_true", help="sessions take turns (all live at once)"
    )
    ap.add_argument("--max-len", type=int, default=16384)
    ap.add_argument("--kv-tokens", type=int, default=65536)
    ap.add_argument("--step-tokens", type=int, default=512)
    ap.add_argument("--retention", default="tiered", choices=("tiered", "lru"))
    ap.add_argument(
        "--restart", action="store_true", help="also measure spill + resume after a restart"
    )
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--torch-threads", type=int, default=1, help="1 avoids OpenMP thrash on a shared box"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.torch_threads)
    styles = args.styles.split(",")
    root = Path(tempfile.gettempdir()) / "ft_bench_agent_replay"
    path = model_dir(args.model, root)
    sessions = {
        s: make_session(s, args.turns, args.seed + i, args.lines, args.keep, args.every)
        for i, s in enumerate(styles)
    }
    runs = []
    for strategy in filter(None, args.strategies.split(",")):
        t0 = time.perf_counter()
        runs.append(replay(path, strategy, sessions, args))
        print(f"[{strategy}: {time.perf_counter() - t0:.0f} s]", file=sys.stderr)
    same = True
    if runs:
        per_turn(runs, styles)
        print()
        same = report(runs, styles)
    if args.restart:
        restart_cost(path, sessions, args, root)
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
