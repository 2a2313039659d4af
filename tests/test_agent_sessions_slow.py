"""Real agent loops end to end (issue 46 item 2): Claude Code, Codex CLI and OpenCode each run a
scripted coding session in a temporary git repository against the daemon.

The daemon runs in the test-only scripted-reply mode (server/scripted.py): the script is the
model's side of the session (read a file, edit it, run it, commit, read another, answer; the
first turn thinks), the real model writes each reply's tokens under a one-token mask, and the
CLI parses them, runs the tools for real in the repository and sends the results back. Each
step's entry is keyed on the previous tool's output, so the session advances only when the
CLI really ran the tool the script named.

Checked: the repository ends in the scripted state (the fix committed, the tree clean), every
step of the script was reached in order, the CLI reports each call as the tool the script named,
and from the second request of the session on the daemon reported as cached at least the tokens
before the request's first difference from the previous one (the CLI's side requests, other
prompts, are their own conversations). Printed: prompt, cached and re-prefilled tokens per turn,
and the sum against the every-anchor floor (what a snapshot at every anchor token would leave to
prefill).

One more OpenCode session edits its earlier context: OpenCode compacts it in the middle (its own
auto-compaction, the model's limits set so a build log read in the session crosses them), the
script answers the compaction request with a summary, and the session goes on from it. The
compaction request is its own conversation; the request after it is checked against the one
before the compaction (it keeps the system prompt and replaces the rest).

Opt-in like tests/test_agents_slow.py (``make test-slow``); ``FT_AGENT_TIMEOUT`` bounds each
CLI run.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import test_agents_slow as agents
from server_support.daemon import Daemon, start_daemon, state_dir
from tokenizers import Tokenizer

from freetokend.models.families.spec import CHATML_ANCHORS

pytestmark = pytest.mark.slow

SERVED = agents.SERVED
TASK = "Fix the greeting in greet.py, run it, commit the fix, then check NOTES.md."
GREET_BEFORE = 'print("helo, world")  # greet-v1\n'
GREET_AFTER = 'print("hello, world")  # greet-v1\n'
NOTES = "Release notes: the greeting is printed once. notes-v1\n"
COMMIT = "greeting-commit"
FINAL = "Done: the greeting is fixed, runs, and is committed."


@dataclass(frozen=True)
class Tools:
    """One CLI's tool names and argument spellings for the session's steps."""

    read: Callable[[Path], tuple[str, dict[str, Any]]]
    edit: Callable[[Path, str, str], tuple[str, dict[str, Any]]]
    shell: Callable[[str], tuple[str, dict[str, Any]]]
    edited: str  # text in the edit's tool result


def call(pair: tuple[str, dict[str, Any]]) -> dict[str, Any]:
    return {"name": pair[0], "arguments": pair[1]}


def session_script(repo: Path, tools: Tools, transcript: Path) -> dict[str, Any]:
    """The model's side: six main turns, each keyed on the previous tool's output."""
    greet = repo / "greet.py"
    steps = [
        (
            "Fix the greeting",
            {
                "reasoning": "The user wants the greeting fixed. I will read greet.py first.",
                "tool_calls": [call(tools.read(greet))],
            },
        ),
        (
            "greet-v1",
            {
                "reasoning": "The word helo is misspelt.",
                "tool_calls": [call(tools.edit(greet, "helo, world", "hello, world"))],
            },
        ),
        (tools.edited, {"tool_calls": [call(tools.shell("python3 greet.py && echo ran-ok"))]}),
        (
            "ran-ok",
            {
                "content": "It prints the right greeting. Committing.",
                "tool_calls": [call(tools.shell(f"git commit -qam {COMMIT} && git log --oneline"))],
            },
        ),
        (COMMIT, {"tool_calls": [call(tools.read(repo / "NOTES.md"))]}),
        ("notes-v1", {"content": FINAL}),
    ]
    # the later steps first: a tool result may quote an earlier step's key (an edit's snippet)
    replies = [
        {"match": key, "tools": True, "step": i, "reply": reply}
        for i, (key, reply) in reversed(list(enumerate(steps)))
    ]
    return {
        "replies": replies,
        "default": {"content": "Greeting fix"},  # side requests: titles, summaries
        "transcript": str(transcript),
    }


def make_repo(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "greet.py").write_text(GREET_BEFORE)
    (path / "NOTES.md").write_text(NOTES)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@example.com"]
    subprocess.run(["git", "init", "-q"], cwd=path, check=True)
    subprocess.run(["git", "config", "user.name", "t"], cwd=path, check=True)
    subprocess.run(["git", "config", "user.email", "t@example.com"], cwd=path, check=True)
    subprocess.run(["git", "add", "."], cwd=path, check=True)
    subprocess.run([*git, "commit", "-qm", "initial"], cwd=path, check=True)
    return path


def assert_final_state(repo: Path) -> None:
    assert (repo / "greet.py").read_text() == GREET_AFTER
    log = subprocess.run(["git", "log", "--format=%s"], cwd=repo, capture_output=True, text=True)
    assert log.stdout.split() == [COMMIT, "initial"], log.stdout
    status = subprocess.run(["git", "status", "--porcelain"], cwd=repo, capture_output=True)
    assert status.stdout.decode().strip() == "", status.stdout


# --- the daemon and the measurements ---------------------------------------------------------


@dataclass
class Scripted:
    daemon: Daemon
    script: Path
    transcript: Path
    anchor_ids: set[int]
    hybrid: bool


def scripted_daemon(folder: Path, *args: str, hybrid: bool = True) -> Iterator[Scripted]:
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "script.json"
    transcript = folder / "transcript.jsonl"
    script.write_text(json.dumps({"replies": [], "transcript": str(transcript)}))
    env = {"FREETOKEN_TEST_MODE": "scripted-replies", "FREETOKEN_TEST_SCRIPT": str(script)}
    d = start_daemon("--served-model-name", SERVED, *args, env=env)
    try:
        tok = json.loads((model_dir(args) / "tokenizer.json").read_text())
        added = {t["content"]: t["id"] for t in tok["added_tokens"]}
        anchors = {added[text] for text, _ in CHATML_ANCHORS if text in added}
        yield Scripted(d, script, transcript, anchors, hybrid)
    finally:
        d.stop()


def model_dir(args: tuple[str, ...]) -> Path:
    if "--model" in args:
        return Path(args[args.index("--model") + 1])
    return state_dir() / "models" / "builtin-qwen35moe-tiny"


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scripted]:
    yield from scripted_daemon(tmp_path_factory.mktemp("hybrid"))


@pytest.fixture(scope="module")
def attention_only(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scripted]:
    folder = tmp_path_factory.mktemp("qwen3moe")
    ckpt = qwen3_moe_checkpoint(folder / "model")
    yield from scripted_daemon(folder, "--model", str(ckpt), hybrid=False)


def qwen3_moe_checkpoint(out: Path) -> Path:
    """A tiny random Qwen3-MoE (attention only) with the built-in model's tokenizer and chat
    template (ChatML, <think>, <tool_call> JSON)."""
    from tiny_models import make_tiny

    builtin = model_dir(())
    tok = json.loads((builtin / "tokenizer.json").read_text())
    vocab = max(t["id"] for t in tok["added_tokens"]) + 1
    # the clients' prompts are tens of thousands of tokens: the built-in model's context
    make_tiny("qwen3_moe", out, seed=7, vocab_size=vocab, max_position_embeddings=131072)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (builtin / name).exists():
            shutil.copy(builtin / name, out / name)
    cfg = json.loads((out / "config.json").read_text())
    builtin_cfg = json.loads((builtin / "config.json").read_text())
    for key in ("eos_token_id", "pad_token_id", "bos_token_id"):
        if key in builtin_cfg:
            cfg[key] = builtin_cfg[key]
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def common(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def check_reuse(s: Scripted, run: agents.Run, since: int, label: str) -> list[int]:
    """The requests answered from the script's steps: their steps in order, and each one's
    cached tokens against its first difference from the previous request of its conversation
    (an entry's ``conversation``, "main" when it has none: a compaction request is its own)."""
    lines = s.transcript.read_text().splitlines()[since:]
    records = [json.loads(line) for line in lines]
    done = {r["request_id"]: r for r in run.records if r.get("event") == "request"}
    script = json.loads(s.script.read_text())
    step_of = [e["step"] for e in script["replies"]]
    conv_of = [e.get("conversation", "main") for e in script["replies"]]
    main = [r for r in records if r["entry"] >= 0]
    steps = [step_of[r["entry"]] for r in main]
    print(f"\n[{label}] {len(records)} requests, {len(main)} in the session; steps {steps}")
    print(" turn  conversation  prompt  cached  1st-diff  re-prefilled  every-anchor floor")
    total = floor_total = 0
    problems = []
    last: dict[str, dict[str, Any]] = {}  # each conversation's previous request
    for n, r in enumerate(main):
        rec = done.get(r["request_id"])
        assert rec is not None, f"no log record for {r['request_id']}"
        prompt, cached = rec["prompt_tokens"], rec["cached_tokens"]
        assert prompt == len(r["prompt_ids"])
        conv = conv_of[r["entry"]]
        prev = last.get(conv)
        last[conv] = r
        diff = (
            0 if prev is None else common(r["prompt_ids"], prev["prompt_ids"] + prev["reply_ids"])
        )
        reusable = diff
        if s.hybrid:  # a recurrent state resumes only after an anchor token
            reusable = max(
                (p + 1 for p in range(diff) if r["prompt_ids"][p] in s.anchor_ids), default=0
            )
        floor = prompt - reusable
        total += prompt - cached
        floor_total += floor
        print(
            f" {n + 1:4d}  {conv:>12}  {prompt:6d}  {cached:6d}  {diff:8d}  "
            f"{prompt - cached:12d}  {floor:8d}"
        )
        before = 0 if prev is None else common(r["prompt_ids"], prev["prompt_ids"])
        if cached < before:
            problems.append(f"turn {n + 1}: cached {cached} < {before} tokens before the diff")
    print(f" sum re-prefilled {total}, every-anchor floor {floor_total}")
    assert not problems, "\n".join(problems)
    return steps


def transcript_since(s: Scripted) -> int:
    return len(s.transcript.read_text().splitlines()) if s.transcript.exists() else 0


def run_session(
    s: Scripted,
    tmp_path: Path,
    tools: Tools,
    launch: Callable[[Daemon, Path, Path], agents.Run],
    label: str,
    script: Callable[[Path, Tools, Path], dict[str, Any]] = session_script,
    steps: int = 6,
) -> tuple[agents.Run, Path, list[dict[str, Any]]]:
    """Run one scripted session; returns the CLI's run, the repository and the daemon's
    transcript lines of the session's requests."""
    repo = make_repo(tmp_path / "repo")
    s.script.write_text(json.dumps(script(repo, tools, s.transcript)))
    since = transcript_since(s)
    run = launch(s.daemon, tmp_path, repo)
    assert run.code == 0, run.report()
    problems = [r for r in run.records if r.get("event") in ("request rejected", "unhandled error")]
    assert not problems, run.report()
    reached = check_reuse(s, run, since, label)
    assert reached == list(range(steps)), run.report()
    assert_final_state(repo)
    lines = s.transcript.read_text().splitlines()[since:]
    return run, repo, [json.loads(line) for line in lines]


# --- Claude Code -----------------------------------------------------------------------------

CLAUDE_TOOLS = Tools(
    read=lambda p: ("Read", {"file_path": str(p)}),
    edit=lambda p, old, new: ("Edit", {"file_path": str(p), "old_string": old, "new_string": new}),
    shell=lambda cmd: ("Bash", {"command": cmd, "description": "Run a command"}),
    edited="has been updated",
)


def claude_launch(daemon: Daemon, tmp_path: Path, repo: Path) -> agents.Run:
    exe = agents.client("claude")
    env = agents.claude_env(daemon, tmp_path / "home")
    argv = [str(exe), "-p", TASK, "--output-format", "stream-json", "--verbose"]
    argv += ["--allowedTools", "Read,Edit,Bash", "--permission-mode", "acceptEdits"]
    return agents.run_client(daemon, argv, env, repo)


def claude_tool_names(run: agents.Run) -> list[str]:
    names = []
    for e in agents.json_lines(run.stdout):
        if e.get("type") == "assistant":
            for block in e.get("message", {}).get("content", []):
                if block.get("type") == "tool_use":
                    names.append(block["name"])
    return names


def test_claude_code_session(hybrid: Scripted, tmp_path: Path) -> None:
    run, _, _ = run_session(hybrid, tmp_path, CLAUDE_TOOLS, claude_launch, "claude-code, hybrid")
    assert claude_tool_names(run) == ["Read", "Edit", "Bash", "Bash", "Read"], run.report()


# --- Codex CLI -------------------------------------------------------------------------------


def codex_edit(path: Path, old: str, new: str) -> tuple[str, dict[str, Any]]:
    """Codex edits through apply_patch, which it intercepts in a shell command."""
    patch = (
        f"apply_patch <<'EOF'\n*** Begin Patch\n*** Update File: {path.name}\n"
        f"@@\n-{GREET_BEFORE.rstrip()}\n+{GREET_AFTER.rstrip()}\n*** End Patch\nEOF\n"
    )
    assert old in GREET_BEFORE and new in GREET_AFTER
    return "exec_command", {"cmd": patch, "workdir": str(path.parent)}


CODEX_TOOLS = Tools(
    read=lambda p: ("exec_command", {"cmd": f"cat {p.name}", "workdir": str(p.parent)}),
    edit=codex_edit,
    shell=lambda cmd: ("exec_command", {"cmd": cmd}),
    edited="Updated the following files",  # apply_patch's report
)


def codex_launch(daemon: Daemon, tmp_path: Path, repo: Path) -> agents.Run:
    exe = agents.client("codex")
    env = agents.codex_env(daemon, tmp_path / "home", sandbox="danger-full-access")
    argv = [str(exe), "exec", "--strict-config", "--ephemeral", "--json", TASK]
    return agents.run_client(daemon, argv, env, repo)


def codex_items(run: agents.Run) -> list[str]:
    items = []
    for e in agents.json_lines(run.stdout):
        if e.get("type") == "item.completed":
            items.append(e.get("item", {}).get("type", "?"))
    return items


def test_codex_session(hybrid: Scripted, tmp_path: Path) -> None:
    run, _, _ = run_session(hybrid, tmp_path, CODEX_TOOLS, codex_launch, "codex, hybrid")
    # its notices ("error": no model metadata) and messages aside: the five tool calls, the edit
    # an apply_patch Codex intercepted in the shell command and applied itself
    kinds = [k for k in codex_items(run) if k not in ("error", "reasoning", "agent_message")]
    shell = "command_execution"
    assert kinds == [shell, "file_change", shell, shell, shell], run.report()


# --- OpenCode --------------------------------------------------------------------------------

OPENCODE_TOOLS = Tools(
    read=lambda p: ("read", {"filePath": str(p)}),
    edit=lambda p, old, new: ("edit", {"filePath": str(p), "oldString": old, "newString": new}),
    shell=lambda cmd: ("bash", {"command": cmd, "description": "Run a command"}),
    edited="Edit applied successfully",
)


def opencode_launch(daemon: Daemon, tmp_path: Path, repo: Path) -> agents.Run:
    exe = agents.client("opencode")
    env = agents.opencode_env(daemon, tmp_path / "home")
    argv = [str(exe), "run", "--pure", "--print-logs", "--log-level", "WARN", "--format", "json"]
    return agents.run_client(daemon, [*argv, TASK], env, repo)


def opencode_tool_names(run: agents.Run) -> list[str]:
    return [
        e.get("part", {}).get("tool", "?")
        for e in agents.json_lines(run.stdout)
        if e.get("type") == "tool_use"
    ]


def test_opencode_session(hybrid: Scripted, tmp_path: Path) -> None:
    run, _, _ = run_session(hybrid, tmp_path, OPENCODE_TOOLS, opencode_launch, "opencode, hybrid")
    assert opencode_tool_names(run) == ["read", "edit", "bash", "bash", "read"], run.report()


def test_opencode_session_attention_only(attention_only: Scripted, tmp_path: Path) -> None:
    run, _, _ = run_session(
        attention_only, tmp_path, OPENCODE_TOOLS, opencode_launch, "opencode, qwen3-moe"
    )
    assert opencode_tool_names(run) == ["read", "edit", "bash", "bash", "read"], run.report()


# --- OpenCode compacts in the middle of the session ------------------------------------------
#
# OpenCode (session/compaction in the pinned 1.18.33) compacts on its own when a finished step's
# reported tokens (prompt + completion) reach the model's context limit less its output limit.
# The compaction is its own request: the "compaction" agent's prompt, no tools, one user message
# holding the summary instructions and the transcript of the older messages written out as
# "[User]: ...", "[Assistant tool call]: ...", "[Tool result]: ...". The session then goes on
# from the summary: the next request keeps the system prompt, puts a synthetic user message and
# the summary (the assistant's answer) where the conversation was, keeps a recent tail of it
# verbatim if one fits, and adds a synthetic "Continue if you have next steps ..." user message.
#
# Here the session reads a build log of some thousands of tokens: the step after it crosses the
# limit, wherever the system prompt's few varying tokens (date, paths) put it.

BUILD_LOG_LINES = 40  # about 1.9 K tokens
COMPACT_KEY = "[Assistant tool call]: "  # only in the compaction request's transcript
CONTINUE_KEY = "Continue if you have next steps"
SUMMARY = (
    "summary-v1: greet.py had the typo helo; it was fixed, it prints the right greeting, the "
    "build log reports no errors and the fix is committed. Left to do: check NOTES.md."
)
# The model's limits for this session. OpenCode compacts once a step's prompt + completion
# tokens reach context - output = 24 K: measured, the step that asks for the log ends at about
# 22.9 K and the one after it (the log in its prompt) at about 24.9 K, a K of margin each side.
COMPACT_CONTEXT = 28000
COMPACT_OUTPUT = 4000


def build_log() -> str:
    lines = [
        f"[build {i:03d}] compiled module_{i:03d}.o in 0.{i % 10}s, 0 warnings"
        for i in range(BUILD_LOG_LINES)
    ]
    return "\n".join([*lines, "log-end: build ok"]) + "\n"


def compacting_script(repo: Path, tools: Tools, transcript: Path) -> dict[str, Any]:
    """The session of session_script with a build log read before the commit, a compaction
    request answered with SUMMARY, and the rest of the session after it."""
    (repo / "build.log").write_text(build_log())
    with open(repo / ".git" / "info" / "exclude", "a") as f:
        f.write("build.log\n")  # untracked and ignored: the tree stays clean
    greet = repo / "greet.py"
    steps: list[tuple[str, dict[str, Any], str]] = [
        (
            "Fix the greeting",
            {
                "reasoning": "The user wants the greeting fixed. I will read greet.py first.",
                "tool_calls": [call(tools.read(greet))],
            },
            "main",
        ),
        (
            "greet-v1",
            {
                "reasoning": "The word helo is misspelt.",
                "tool_calls": [call(tools.edit(greet, "helo, world", "hello, world"))],
            },
            "main",
        ),
        (
            tools.edited,
            {"tool_calls": [call(tools.shell("python3 greet.py && echo ran-ok"))]},
            "main",
        ),
        (
            "ran-ok",
            {
                "content": "It prints the right greeting. Checking the build log.",
                "tool_calls": [call(tools.shell("cat build.log"))],
            },
            "main",
        ),
        (
            "log-end",
            {"tool_calls": [call(tools.shell(f"git commit -qam {COMMIT} && git log --oneline"))]},
            "main",
        ),
        (COMPACT_KEY, {"content": SUMMARY}, "compaction"),
        (CONTINUE_KEY, {"tool_calls": [call(tools.read(repo / "NOTES.md"))]}, "main"),
        ("notes-v1", {"content": FINAL}, "main"),
    ]
    # the compaction request first (its transcript quotes every earlier key), then the later
    # steps first (a tool result may quote an earlier step's key)
    order = [5, 7, 6, 4, 3, 2, 1, 0]
    replies = []
    for i in order:
        key, reply, conversation = steps[i]
        entry = {"match": key, "step": i, "conversation": conversation, "reply": reply}
        if conversation == "main":
            entry["tools"] = True
        replies.append(entry)
    return {
        "replies": replies,
        "default": {"content": "Greeting fix"},
        "transcript": str(transcript),
    }


def opencode_compacting_launch(daemon: Daemon, tmp_path: Path, repo: Path) -> agents.Run:
    exe = agents.client("opencode")
    home = tmp_path / "home"
    env = agents.opencode_env(daemon, home)
    config = json.loads((home / "opencode.json").read_text())
    limit = {"context": COMPACT_CONTEXT, "output": COMPACT_OUTPUT}
    config["provider"]["freetoken"]["models"][SERVED]["limit"] = limit
    config["compaction"] = {"auto": True}
    (home / "opencode.json").write_text(json.dumps(config, indent=2))
    argv = [str(exe), "run", "--pure", "--print-logs", "--log-level", "WARN", "--format", "json"]
    return agents.run_client(daemon, [*argv, TASK], env, repo)


def test_opencode_session_compaction(hybrid: Scripted, tmp_path: Path) -> None:
    run, _, requests = run_session(
        hybrid,
        tmp_path,
        OPENCODE_TOOLS,
        opencode_compacting_launch,
        "opencode compacting, hybrid",
        script=compacting_script,
        steps=8,
    )
    assert opencode_tool_names(run) == ["read", "edit", "bash", "bash", "bash", "read"], (
        run.report()
    )
    tok = Tokenizer.from_file(str(model_dir(()) / "tokenizer.json"))
    script = json.loads(hybrid.script.read_text())
    by_step = {script["replies"][r["entry"]]["step"]: r for r in requests if r["entry"] >= 0}
    text = {
        step: tok.decode(r["prompt_ids"], skip_special_tokens=False) for step, r in by_step.items()
    }
    # the compaction request: its own conversation (no tools), the session written out in it
    assert "[Tool result]: " in text[5] and "greet-v1" in text[5] and COMMIT in text[5]
    assert "<tools>" in text[4] and "<tools>" not in text[5]
    # the request after it: the earlier context edited, not appended to. It differs from the
    # one before the compaction inside that one's prompt, the old read of greet.py is gone and
    # the summary stands where the conversation was
    before, after = by_step[4]["prompt_ids"], by_step[6]["prompt_ids"]
    first_diff = common(after, before)
    assert 0 < first_diff < len(before), (first_diff, len(before))
    assert "greet-v1" in text[4] and "greet-v1" not in text[6]
    assert SUMMARY in text[6] and CONTINUE_KEY in text[6]
    print(
        f" compaction: the request after it differs from the one before at token {first_diff}"
        f" of {len(before)} (now {len(after)} tokens)"
    )
