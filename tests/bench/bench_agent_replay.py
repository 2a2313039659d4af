"""Agent replay: re-prefilled tokens and TTFT per harness under snapshot policies, against an
oracle floor (ARCHITECTURE §5.3).

Scripted coding-agent sessions as five real harnesses send them (tests/agent_harnesses.py:
qwen, claude-code, opencode, codex, sweagent) are rendered through a chat template (Qwen3's
behaviour by default: reasoning dropped before the last user message; or the model's own) and
served turn by turn by one engine per policy and snapshot budget:

  oracle       a snapshot at every anchor, unbounded budget: the floor no policy can beat
  anchors      the default policy (recent anchors + learned edit frontier, kv/snapshots.py)
  interval:64  a snapshot every 64 tokens (the baseline)
  none         prefix cache on, no recurrent snapshots (a hybrid model then reuses nothing)

The harnesses' sessions are served one after another by the same engine and share the system
prompt (and the task message), so a session's first requests run along another's cached path,
as parallel agents of one harness do. Budgets are given in snapshots of the model: 4 (the
default: 256 MB holds about four snapshots of a Qwen3.5-35B-A3B-sized recurrent state) and 2
(tight). Every turn greedily generates a few
tokens; outputs must be identical across policies (fp32). Prints per model, budget and harness:
re-prefilled tokens (turns 1..), their ratio to the oracle, and the worst turn's TTFT (wall and
process CPU time: the latter is steadier on a shared machine). Exit status 1 when outputs differ
or, with --check, when the default policy is not within 1.15x of the oracle and below
interval:64 for every harness at the default budget.

    .venv/bin/python tests/bench/bench_agent_replay.py --check           # tiny hybrid + attention
    .venv/bin/python tests/bench/bench_agent_replay.py --models builtin  # the built-in model
    .venv/bin/python tests/bench/bench_agent_replay.py --models tiny-v4  # DeepSeek-V4
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

_TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_TESTS))

import torch  # noqa: E402
from agent_harnesses import HARNESSES, OPENAI_TOOLS, QWEN3_TEMPLATE, Harness, make_script  # noqa: E402

import freetokend.engine.llm as llm_module  # noqa: E402
from freetokend import LLM  # noqa: E402
from freetokend.engine.chat_template import ChatTemplate  # noqa: E402
from freetokend.engine.sampler import SamplingParams  # noqa: E402
from freetokend.models.builtin import ensure_builtin_model  # noqa: E402
from freetokend.models.families.spec import CHATML_ANCHORS, CHATML_TURN_HEADER  # noqa: E402

POLICIES = ("oracle", "anchors", "interval:64", "none")
DEFAULT_POLICIES = "oracle,anchors,interval:64"
UNBOUNDED_MB = 1 << 20


@dataclass
class TurnResult:
    prompt: int
    cached: int
    ttft_s: float
    output: list[int]
    ttft_cpu_s: float = 0.0

    @property
    def prefilled(self) -> int:
        return self.prompt - self.cached


@dataclass
class Run:
    policy: str
    turns: dict[str, list[TurnResult]] = field(default_factory=dict)

    def total(self, harness: str) -> int:
        return sum(r.prefilled for r in self.turns[harness][1:])  # turn 0 reuses nothing

    def worst_ttft(self, harness: str) -> tuple[float, float]:
        rs = self.turns[harness][1:]
        return max(r.ttft_s for r in rs), max(r.ttft_cpu_s for r in rs)


MODELS = {"tiny-hybrid": "qwen3_5_moe", "tiny-attn": "qwen3_moe", "tiny-v4": "deepseek_v4"}


def model_dir(kind: str, root: Path) -> Path:
    """builtin: the built-in model; tiny-hybrid / tiny-attn / tiny-v4: random Qwen3.5-MoE
    (Gated DeltaNet + attention) / Qwen3-MoE (attention only) / DeepSeek-V4 (sliding window,
    CSA and HCA: its compressed entries in the KV pages, the windows' keys and open
    compressor windows per sequence, snapshotted at anchors) of
    tests/tiny_models.py sharing its tokenizer."""
    builtin = ensure_builtin_model(root / "state")
    if kind == "builtin":
        return builtin
    family = MODELS.get(kind)
    if family is None:
        return Path(kind)
    from tiny_models import make_tiny

    out = root / f"{kind}-416"
    if not (out / "config.json").exists():
        make_tiny(family, out, seed=5, vocab_size=416, max_position_embeddings=32768)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(builtin / name, out / name)
    return out


def serve_turn(llm: LLM, rid: str, ids: list[int], gen: int) -> TurnResult:
    """One request through the engine: TTFT is add_request -> first sampled token."""
    eng = llm.engine
    t0, c0 = time.perf_counter(), time.process_time()
    eng.add_request(rid, ids, SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True))
    out: list[int] = []
    ttft = cpu = 0.0
    cached = 0
    while eng.has_unfinished():
        for o in eng.step():
            if not out:
                ttft, cpu = time.perf_counter() - t0, time.process_time() - c0
            out.append(o.token_id)
            cached = o.num_cached_tokens
    return TurnResult(len(ids), cached, ttft, out, cpu)


def prompts(path: Path, args: argparse.Namespace) -> dict[str, list[list[int]]]:
    """Token ids of every request of every harness session."""
    llm = LLM(path, max_model_len=args.max_len, kv_tokens=64, dtype="float32", prefix_cache=False)
    template = (
        ChatTemplate({"default": QWEN3_TEMPLATE}) if args.template == "qwen3" else llm.chat_template
    )
    out = {}
    for name in args.harnesses:  # each harness its own script, whichever others run
        h = Harness(name, make_script(args.turns, args.seed + HARNESSES.index(name), args.lines))
        out[name] = [
            llm.tokenizer.encode(
                template.render(h.messages(t), tools=OPENAI_TOOLS, add_generation_prompt=True)
            )
            for t in range(args.turns + 1)
        ]
    return out


@contextlib.contextmanager
def chatml_anchors(on: bool):  # type: ignore[no-untyped-def]
    """With ``on`` (prompts rendered by the Qwen3 template: ChatML), every family's snapshot
    policy takes ChatML's anchors and turn header, the markup the prompts have: a tiny model of
    another family (tiny-v4) with the built-in tokenizer would otherwise look for its own
    family's markup, which these prompts do not contain."""
    if not on:
        yield
        return
    real = llm_module.family_spec

    def spec(family: str):  # type: ignore[no-untyped-def]
        return dataclasses.replace(
            real(family), anchors=CHATML_ANCHORS, turn_header=CHATML_TURN_HEADER
        )

    llm_module.family_spec = spec  # type: ignore[assignment]
    try:
        yield
    finally:
        llm_module.family_spec = real


def replay(
    path: Path,
    policy: str,
    budget: float,
    ids: dict[str, list[list[int]]],
    args: argparse.Namespace,
) -> Run:
    probe = LLM(path, max_model_len=args.max_len, kv_tokens=64, dtype="float32", prefix_cache=False)
    state = probe.runner.new_state()
    if state.recurrent is not None:
        snap_bytes = state.recurrent.nbytes
    else:  # a model's own state (DeepSeek-V4): the most a snapshot of it holds, any position
        snap_bytes = probe.runner.model.state_bytes_per_seq()
    snap_mb = snap_bytes / 2**20
    del probe
    with chatml_anchors(args.template == "qwen3"):
        llm = LLM(
            path,
            max_model_len=args.max_len,
            kv_tokens=args.kv_tokens,
            dtype="float32",
            snapshot_policy="anchors:all" if policy == "oracle" else policy,
            snapshot_budget_mb=UNBOUNDED_MB if policy == "oracle" else budget * snap_mb,
            max_step_tokens=args.step_tokens,
        )
    run = Run(policy, {h: [] for h in ids})
    order = [(t, h) for h in ids for t in range(args.turns + 1)]
    if args.interleave:
        order = [(t, h) for t in range(args.turns + 1) for h in ids]
    for t, h in order:
        run.turns[h].append(serve_turn(llm, f"{h}-{t}", ids[h][t], args.gen))
    return run


def report(model: str, budget: float, runs: list[Run], harnesses: list[str]) -> list[str]:
    """Prints the table of one model and budget; returns the failed checks."""
    oracle = next(r for r in runs if r.policy == "oracle")
    by = {r.policy: r for r in runs}
    fails = []
    for h in harnesses:
        floor = oracle.total(h)
        for run in runs:
            total = run.total(h)
            wall, cpu = run.worst_ttft(h)
            ratio = total / floor if floor else float("nan")
            print(
                f"{model:12} {budget:6g} {h:12} {run.policy:12} {total:9d} {ratio:7.3f} "
                f"{wall:9.3f} {cpu:9.3f}"
            )
        if "anchors" in by and "interval:64" in by:
            ours, base = by["anchors"].total(h), by["interval:64"].total(h)
            if ours > 1.15 * floor:
                fails.append(
                    f"{model} budget {budget:g} {h}: anchors {ours} > 1.15 x oracle {floor}"
                )
            if ours >= base and base > floor:
                fails.append(f"{model} budget {budget:g} {h}: anchors {ours} >= interval:64 {base}")
    return fails


def per_turn(runs: list[Run], harnesses: list[str]) -> None:
    for h in harnesses:
        print(f"  {h}: re-prefilled per turn (prompt length first)")
        print("  prompt  " + " ".join(f"{r.prompt:6d}" for r in runs[0].turns[h]))
        for run in runs:
            print(f"  {run.policy[:7]:7} " + " ".join(f"{r.prefilled:6d}" for r in run.turns[h]))


def timed(path: Path, policy: str, budget: float, ids, args) -> Run:  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    out = replay(path, policy, budget, ids, args)
    print(f"[{path.name} {budget:g} {policy}: {time.perf_counter() - t0:.0f} s]", file=sys.stderr)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--models",
        default="tiny-hybrid,tiny-attn",
        help=f"builtin | {' | '.join(MODELS)} | a folder",
    )
    ap.add_argument("--harnesses", default=",".join(HARNESSES))
    ap.add_argument("--policies", default=DEFAULT_POLICIES, help=f"of {POLICIES}")
    ap.add_argument(
        "--budgets", default="4,2", help="snapshot budgets, in snapshots; the first is the default"
    )
    ap.add_argument("--template", default="qwen3", choices=("qwen3", "model"))
    ap.add_argument("--turns", type=int, default=12)  # opencode prunes, claude-code compacts
    ap.add_argument("--lines", type=int, default=30, help="mean lines of a tool output")
    ap.add_argument("--gen", type=int, default=3, help="tokens generated per turn")
    ap.add_argument("--interleave", action="store_true", help="sessions take turns (all live)")
    ap.add_argument("--max-len", type=int, default=32768)
    ap.add_argument("--kv-tokens", type=int, default=131072)
    ap.add_argument("--step-tokens", type=int, default=512)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--per-turn", action="store_true")
    ap.add_argument("--check", action="store_true", help="exit 1 unless the acceptance bounds hold")
    ap.add_argument("--torch-threads", type=int, default=1, help="1 avoids OpenMP thrash")
    args = ap.parse_args()
    torch.set_num_threads(args.torch_threads)
    args.harnesses = args.harnesses.split(",")
    root = Path(tempfile.gettempdir()) / "ft_bench_agent_replay"
    print(
        f"{'model':12} {'budget':>6} {'harness':12} {'policy':12} {'re-prefill':>9} {'x floor':>7} "
        f"{'TTFT max s':>9} {'CPU max s':>9}"
    )
    fails: list[str] = []
    same = True
    for model in args.models.split(","):
        path = model_dir(model, root)
        ids = prompts(path, args)
        budgets = [float(b) for b in args.budgets.split(",")]
        policies = args.policies.split(",")
        oracle = timed(path, "oracle", 0, ids, args)
        outs = {h: [r.output for r in oracle.turns[h]] for h in args.harnesses}
        for i, budget in enumerate(budgets):
            runs = [oracle]
            for policy in (p for p in policies if p != "oracle"):
                run = timed(path, policy, budget, ids, args)
                same &= {h: [r.output for r in run.turns[h]] for h in args.harnesses} == outs
                runs.append(run)
            checks = report(model, budget, runs, args.harnesses)
            fails += checks if i == 0 else []  # the bounds are asked at the default budget
            if args.per_turn:
                per_turn(runs, args.harnesses)
    print("greedy outputs identical across policies and budgets:", same)
    for f in fails:
        print("CHECK FAILED:", f)
    sys.exit(0 if same and not (args.check and fails) else 1)


if __name__ == "__main__":
    main()
