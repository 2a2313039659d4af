"""Prefix reuse (ARCHITECTURE §5): outputs with reuse equal outputs without, across agent sessions in the
three context-editing styles; cached-token accounting against an independent oracle; no leaked
or corrupted KV pages; eviction under a small pool; the snapshot budget."""

from __future__ import annotations

import os
import time

import pytest
import torch
from agent_sessions import MARKER_ANCHORS, STYLES, TOOLS, make_session, render_tokens
from tiny_models import make_tiny

from freetokend import LLM
from freetokend.engine.prefix import PrefixReuse, SnapshotPolicy
from freetokend.engine.sampler import SamplingParams
from freetokend.kv import recency
from freetokend.kv.edits import EditModel
from freetokend.kv.pool import KVPool
from freetokend.kv.radix import RadixCache
from freetokend.kv.seq_state import RecurrentState, SeqState
from freetokend.kv.snapshots import SnapshotStore
from freetokend.store import Store

GEN = 5  # tokens generated per turn
TURNS = 5
BUILTIN_TURNS = 4  # each style edits once (turn 3) and once more (turn 4)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread: on a shared 2-core box OpenMP threads spin against each other (15x)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


# ---- helpers ------------------------------------------------------------------------------------


def serve(llm: LLM, prompts: list[list[int]], gen: int = GEN) -> list[tuple[list[int], int]]:
    """Runs prompts together through the engine: (generated ids, num_cached_tokens) for each."""
    eng = llm.engine
    rids = [f"r{id(p)}-{i}" for i, p in enumerate(prompts)]
    for rid, p in zip(rids, prompts, strict=True):
        eng.add_request(rid, p, SamplingParams(max_tokens=gen, ignore_eos=True))
    out: dict[str, list[int]] = {r: [] for r in rids}
    cached: dict[str, int] = {}
    while eng.has_unfinished():
        for o in eng.step():
            out[o.request_id].append(o.token_id)
            cached[o.request_id] = o.num_cached_tokens
    return [(out[r], cached[r]) for r in rids]


class Oracle:
    """Expected cached tokens, from the token sequences alone (no cache code involved).

    The radix tree holds the KV of every finished request's fed tokens (prompt plus all
    generated tokens but the last, partial last page included); a hybrid model resumes only at a snapshot point of a
    request that shared that prefix: an anchor token, the end of its prompt, or an interval.
    Valid while nothing is evicted (large pool and snapshot budget).
    """

    def __init__(
        self,
        hybrid: bool,
        anchors: set[int],
        interval: int = 0,
        policy: SnapshotPolicy | None = None,
    ) -> None:
        """``policy``: the engine's, when its family has a turn header: each prompt's system
        prompt snapshot is then taken past the next turn's header (kv/recency.first_turn_end)."""
        self.hybrid, self.anchors, self.interval = hybrid, anchors, interval
        self.policy = policy
        self.done: list[tuple[list[int], int]] = []  # (fed tokens, prompt length)
        self.roots: list[int | None] = []  # each done prompt's system-prompt snapshot point

    def expect(self, tokens: list[int]) -> int:
        def lcp(a: list[int], b: list[int]) -> int:
            n = 0
            while n < min(len(a), len(b)) and a[n] == b[n]:
                n += 1
            return n

        shared = [(lcp(tokens, fed), fed, plen) for fed, plen in self.done]
        limit = min(max([n for n, _, _ in shared], default=0), len(tokens) - 1)
        if not self.hybrid:
            return limit
        for p in range(limit, 0, -1):
            for (n, _, plen), root in zip(shared, self.roots, strict=True):
                if n >= p and (self._point(tokens, p, plen) or p == root):
                    return p
        return 0

    def _point(self, tokens: list[int], p: int, plen: int) -> bool:
        if self.interval:
            return p % self.interval == 0
        return tokens[p - 1] in self.anchors or p == plen

    def record(self, prompt: list[int], output: list[int]) -> None:
        self.done.append((prompt + output[:-1], len(prompt)))
        policy = self.policy
        root = None
        if policy is not None and policy.turn_header is not None:
            root = recency.first_turn_end(prompt, len(prompt), policy.kind_at, policy.after_header)
        self.roots.append(root)


def run_sessions(llm: LLM, prompts_of, oracle: Oracle | None, ref: LLM) -> int:
    """Serves every style's session turn by turn on ``llm`` and on the no-reuse ``ref``; asserts
    identical outputs and (with an oracle) exact cached counts. Returns total cached tokens."""
    total = 0
    for style in STYLES:
        for t, prompt in enumerate(prompts_of(style)):
            [(out, cached)] = serve(llm, [prompt])
            [(want, none)] = serve(ref, [prompt])
            assert none == 0
            assert out == want, f"{style} turn {t}: output differs with reuse"
            if oracle is not None:
                assert cached == oracle.expect(prompt), f"{style} turn {t}"
                oracle.record(prompt, out)
            total += cached
    assert llm.engine.stats().kv_pages_used == 0
    return total


def assert_no_leak(llm: LLM) -> None:
    prefix = llm.engine.prefix
    assert prefix is not None
    prefix.radix.clear()
    assert prefix.radix.cached_pages() == 0
    assert llm.runner.kv.num_used == 0, "pages leaked: held by no request and not by the tree"


def token_sessions(vocab: int, turns: int = TURNS):
    sessions = {
        s: make_session(s, turns, seed=7 + i, output_lines=3, keep=2, every=3)
        for i, s in enumerate(STYLES)
    }
    return lambda style: [
        render_tokens(sessions[style].messages(t), vocab) for t in range(turns + 1)
    ]


# ---- the built-in hybrid model, through its chat template ----------------------------------------


@pytest.fixture(scope="module")
def builtin_pair(builtin_model_dir):
    kw = dict(max_model_len=4096, kv_tokens=16384, dtype="float32")
    return LLM(builtin_model_dir, snapshot_policy="anchors:all", **kw), LLM(
        builtin_model_dir, prefix_cache=False, **kw
    )


def test_builtin_sessions_identical_with_exact_accounting(builtin_pair):
    llm, ref = builtin_pair
    sessions = {
        s: make_session(s, BUILTIN_TURNS, seed=1 + i, output_lines=3, keep=2, every=3)
        for i, s in enumerate(STYLES)
    }

    def prompts_of(style: str) -> list[list[int]]:
        render = llm.chat_template.render
        return [
            llm.tokenizer.encode(
                render(sessions[style].messages(t), tools=TOOLS, add_generation_prompt=True)
            )
            for t in range(BUILTIN_TURNS + 1)
        ]

    policy = llm.engine.prefix.policy
    anchors = set(policy.anchor_ids)
    assert len(anchors) == 6  # the ChatML markers all resolve through the tokenizer
    assert policy.turn_header is not None  # <|im_start|> and "\n" too
    total = run_sessions(llm, prompts_of, Oracle(True, anchors, policy=policy), ref)
    assert total > 0
    assert llm.engine.stats().prompt_tokens_cached_total == total
    assert_no_leak(llm)


# ---- tiny models, token-level sessions ---------------------------------------------------------


def _tiny_pair(tmp_path_factory, family: str, **kw):
    d = tmp_path_factory.mktemp(family)
    make_tiny(family, d, seed=3)
    args = dict(moe_backend="cpu", max_model_len=512, **kw)
    return LLM(d, **args), LLM(d, prefix_cache=False, **args)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_non_hybrid_sessions_identical(tmp_path_factory, family):
    """Full-attention and sliding-window models reuse KV at any position (page COW included)."""
    llm, ref = _tiny_pair(tmp_path_factory, family, kv_tokens=8192)
    oracle = Oracle(False, set())
    total = run_sessions(llm, token_sessions(97), oracle, ref)
    assert total > 0
    assert_no_leak(llm)


def _with_marker_policy(llm: LLM, spec: str = "anchors:all", budget: int = 64 << 20) -> PrefixReuse:
    """The tiny models have no tokenizer: anchors are the marker ids of the token-level render."""
    if llm.engine.prefix is not None:
        llm.engine.prefix.radix.clear()  # return the old tree's pages to the pool
    assert llm.runner.kv.num_used == 0
    policy = SnapshotPolicy.parse(spec, dict(MARKER_ANCHORS) if spec.startswith("anchors") else {})
    llm.engine.prefix = PrefixReuse(llm.runner.kv, True, policy, budget)
    return llm.engine.prefix


@pytest.mark.parametrize("spec", ["anchors:all", "anchors", "interval:16"])
def test_tiny_hybrid_sessions_identical(tmp_path_factory, spec):
    """Exact accounting where every snapshot point is taken (anchors:all, interval); the
    selective default (prefill split only at edit-frontier candidates) must stay exact too."""
    llm, ref = _tiny_pair(tmp_path_factory, "qwen3_5_moe", kv_tokens=8192)
    _with_marker_policy(llm, spec)
    interval = int(spec.split(":")[1]) if spec.startswith("interval") else 0
    oracle = None if spec == "anchors" else Oracle(True, set(MARKER_ANCHORS), interval)
    assert run_sessions(llm, token_sessions(97), oracle, ref) > 0
    assert_no_leak(llm)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5_moe"])
def test_eviction_under_small_pool_keeps_outputs(tmp_path_factory, family):
    """A pool of ~2.5 prompts: the tree is evicted constantly, outputs stay identical."""
    llm, ref = _tiny_pair(tmp_path_factory, family, kv_tokens=1024)
    if family == "qwen3_5_moe":
        _with_marker_policy(llm)
    run_sessions(llm, token_sessions(97, turns=6), None, ref)
    assert llm.engine.prefix.radix.evicted > 0
    assert_no_leak(llm)


# ---- copy-on-write, preemption, pool exhaustion ---------------------------------------------------


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return a.dtype == b.dtype and torch.equal(a.contiguous().view(bits), b.contiguous().view(bits))


def test_cow_of_a_shared_partial_page_never_corrupts(tmp_path_factory):
    llm, ref = _tiny_pair(tmp_path_factory, "qwen3_moe", kv_tokens=4096)
    g = torch.Generator().manual_seed(0)
    base = torch.randint(10, 97, (37,), generator=g).tolist()  # 2 full pages + 5 rows
    a = base + torch.randint(10, 97, (20,), generator=g).tolist()
    b = base + torch.randint(10, 97, (20,), generator=g).tolist()
    c = a[:42] + torch.randint(10, 97, (20,), generator=g).tolist()
    want = [o for o, _ in serve(ref, [a, b, c])]
    [(out_a, _)] = serve(llm, [a])
    kv = llm.runner.kv
    tree = [n.page for n in llm.engine.prefix.radix._nodes()]
    before = kv.k[:, tree].clone(), kv.v[:, tree].clone()
    # b leaves the tree 5 rows into page 2, c 10 rows in: both copy page 2 in the same step.
    res = serve(llm, [b, c])
    assert [out_a] + [o for o, _ in res] == want
    assert [n for _, n in res] == [37, 42]
    # bitwise: the pages' unwritten rows are torch.empty bits, NaN among them, and NaN != NaN
    assert _same_bits(kv.k[:, tree], before[0]) and _same_bits(kv.v[:, tree], before[1])
    assert_no_leak(llm)


def test_preempted_request_counts_its_cached_prompt_once(tmp_path_factory):
    """8 pages: the tree's 3 shared pages plus 3 + 3 of two requests do not fit; one is preempted
    (its pages go to the tree) and re-admitted (restoring them): still 48 cached tokens each."""
    llm, ref = _tiny_pair(tmp_path_factory, "qwen3_moe", kv_tokens=128, max_batch=2)
    g = torch.Generator().manual_seed(1)
    base = torch.randint(10, 97, (48,), generator=g).tolist()
    serve(llm, [base], gen=1)  # the tree gets the 3 pages of the prompt (no generated token fed)
    prompts = [base + torch.randint(10, 97, (8,), generator=g).tolist() for _ in range(2)]
    got = serve(llm, prompts, gen=40)
    assert llm.engine.stats().preemptions_total > 0
    assert [o for o, _ in got] == [o for o, _ in serve(ref, prompts, gen=40)]
    assert [c for _, c in got] == [48, 48]
    assert llm.engine.stats().prompt_tokens_cached_total == 96
    assert_no_leak(llm)


def test_restore_with_a_dry_pool_leaves_state_untouched():
    pool = KVPool(1, 4, 4, 1, 2)
    reuse = PrefixReuse(pool, False, SnapshotPolicy.parse("none", {}), 0)
    pages = pool.alloc(2)
    reuse.radix.insert(list(range(8)), pages)  # the tree and a "running request" hold both pages
    pool.alloc(2)  # nothing free, nothing evictable
    refs = [pool.refcount(p) for p in range(4)]
    st = SeqState()
    assert reuse.restore(list(range(6)) + [99, 98], st) == 0  # needs a COW page for rows 4..5
    assert (st.pages, st.num_tokens) == ([], 0)
    assert [pool.refcount(p) for p in range(4)] == refs
    assert reuse.restore(list(range(4)) + [99, 98], st) == 4  # page-aligned: no copy needed
    assert st.pages == pages[:1] and pool.refcount(pages[0]) == refs[pages[0]] + 1


# ---- radix tree and snapshot store units --------------------------------------------------------


def test_radix_match_prefix_enters_a_partial_page():
    pool = KVPool(1, 8, 4, 1, 2)
    radix = RadixCache(pool)
    seq = list(range(10, 22))
    pages = pool.alloc(3)
    radix.insert(seq, pages)
    assert radix.match_prefix(seq) == (pages, 12)
    assert radix.match_prefix(seq[:6] + [0, 0]) == (pages[:2], 6)
    assert radix.match_prefix(seq[:9]) == (pages, 9)  # the prompt ends inside page 2
    assert radix.match_prefix([0] + seq) == ([], 0)
    assert radix.diverges(seq[:6] + [0, 0], 6)  # the tree goes on differently after 6 tokens
    assert not radix.diverges(seq + [1, 2], 12)  # the prompt only extends the cached path
    assert not radix.diverges(seq[:9], 9)  # a prefix of the cached path
    pool.free(pages)
    assert radix.evict(3) == 3 and pool.num_used == 0


def _state(nbytes_per: int = 64) -> RecurrentState:
    n = nbytes_per // 4 // 2
    return RecurrentState(torch.zeros(1, n, 1), torch.zeros(1, 1, n, 1))


def test_snapshot_budget_evicts_least_recently_used():
    st = _state()
    store = SnapshotStore(3 * st.nbytes)
    toks = list(range(100))
    for p in (10, 20, 30):
        assert store.put(toks, p, st, "end_of_turn")
    assert store.get(toks, 10) is not None  # 10 is now the most recently used
    assert store.put(toks, 40, st, "end_of_turn")
    assert sorted(store.positions()) == [10, 30, 40] and store.used == 3 * st.nbytes
    assert store.get(toks[:19] + [7] + toks[20:], 30) is None  # another prefix, same position
    assert not SnapshotStore(st.nbytes - 1).put(
        toks, 5, st, "end_of_turn"
    )  # larger than the budget


# ---- retention under a tight snapshot budget -----------------------------------------------------


def _replay(llm: LLM, prompts: list[list[int]]) -> tuple[int, list[list[int]]]:
    """Re-prefilled tokens over turns 1.. (turn 0 reuses nothing anywhere) and the outputs."""
    prefilled, outs = 0, []
    for t, p in enumerate(prompts):
        [(out, cached)] = serve(llm, [p], gen=2)
        prefilled += (len(p) - cached) * (t > 0)
        outs.append(out)
    return prefilled, outs


def test_tight_budget_anchors_beat_interval_and_no_snapshots(tmp_path_factory):
    """A budget of 4 snapshots and 8-turn sessions: anchors (tiered retention: session heads and
    edit frontiers protected) re-prefill less than snapshots every 16 tokens and than none, in
    every edit style, and less than the first design (a snapshot at every anchor, plain LRU);
    outputs stay identical."""
    d = tmp_path_factory.mktemp("tight")
    make_tiny("qwen3_5_moe", d, seed=3)
    llm = LLM(d, moe_backend="cpu", max_model_len=512, kv_tokens=8192)
    budget = 4 * llm.runner.new_state().recurrent.nbytes
    prompts_of = token_sessions(97, turns=8)
    for style in STYLES:
        prompts = prompts_of(style)
        got = {}
        for spec, retention in (
            ("none", "tiered"),
            ("interval:16", "tiered"),
            ("anchors:all", "lru"),
            ("anchors", "tiered"),
        ):
            reuse = _with_marker_policy(llm, spec, budget)
            reuse.snapshots.retention = retention
            got[spec, retention] = _replay(llm, prompts)
        outs = {str(o) for _, o in got.values()}
        assert len(outs) == 1, f"{style}: outputs differ between strategies"
        best = got["anchors", "tiered"][0]
        others = {k: v[0] for k, v in got.items() if k != ("anchors", "tiered")}
        assert all(best < v for v in others.values()), (style, best, others)


def test_tiered_store_keeps_protected_snapshots():
    st = _state()
    store = SnapshotStore(3 * st.nbytes)
    toks = list(range(100))
    head = store.put(toks, 10, st, "end_of_turn", head=True)
    front = store.put(toks, 20, st, "tool_output_start", frontier=True)
    for p in (30, 40, 50):  # unprotected ones evict each other, never the protected two
        assert store.put(toks, p, st, "tool_call_end")
    assert sorted(store.positions()) == [10, 20, 50]
    assert head is not None and front is not None
    store.mark(head, head=False, frontier=False)  # demoted: unprotected, most recently used
    assert store.put(toks, 60, st, "end_of_turn", head=True)
    assert sorted(store.positions()) == [10, 20, 60]  # 50 was the older unprotected one
    assert store.put(toks, 70, st, "end_of_turn", head=True)
    assert sorted(store.positions()) == [20, 60, 70]
    assert store.put(toks, 80, st, "tool_call_end") is None  # never evicts protected for it
    lru = SnapshotStore(2 * st.nbytes, retention="lru")
    lru.put(toks, 10, st, "end_of_turn", head=True)
    lru.put(toks, 20, st, "x")
    lru.put(toks, 30, st, "x")
    assert sorted(lru.positions()) == [20, 30]  # marks ignored


def test_edit_model_learns_the_kinds_edits_land_on():
    m = EditModel()
    assert m.admits("anything")  # before any edit, every kind may be a frontier
    for _ in range(3):
        m.observe("tool_output_start")
    m.observe("end_of_turn")
    assert m.admits("tool_output_start") and not m.admits("end_of_turn")
    m.observe("end_of_turn")  # the pattern changed: two edits are enough to follow it
    assert m.admits("end_of_turn") and not m.admits("tool_output_start")
    prior = m.fork(EditModel.PRIOR)  # a new session: the engine's habits, lightly held
    prior.observe("tool_output_start")
    assert prior.admits("tool_output_start") and not prior.admits("end_of_turn")
    assert m.admits("end_of_turn")  # forks are independent


def test_radix_keeps_a_partial_last_page_until_a_longer_page_covers_it():
    pool = KVPool(1, 8, 4, 1, 2)
    radix = RadixCache(pool)
    seq = list(range(10, 20))  # 2 full pages + 2 rows
    pages = pool.alloc(3)
    radix.insert(seq, pages)
    pool.free(pages)  # the request ends: the tree alone holds its pages
    assert radix.cached_pages() == 3 and pool.num_used == 3
    assert radix.match_prefix(seq + [1, 2]) == (pages, 10)
    assert radix.match(seq) == pages[:2]  # full pages only
    longer = pool.alloc(1)
    radix.insert(seq + [20, 21], pages[:2] + longer)  # a full page repeats the partial one's rows
    pool.free(longer)
    assert radix.cached_pages() == 3 and pool.refcount(pages[2]) == 0  # the partial one is dropped
    assert radix.match_prefix(seq + [20, 21, 22]) == (pages[:2] + longer, 12)
    radix.insert(seq[:9], pages[:3])  # covered by the longer page: nothing taken
    assert radix.cached_pages() == 3
    radix.clear()
    assert pool.num_used == 0


# ---- spill to disk and resume after a restart -------------------------------------------------------


@pytest.mark.parametrize("rows_lost", [False, True], ids=["rows", "crash-before-rows"])
def test_spilled_snapshots_resume_a_session_after_restart(
    builtin_model_dir, builtin_pair, tmp_path, rows_lost
):
    """Engine A serves three turns and spills on close; a NEW engine B on the same state dir
    prefills only the fourth turn's suffix: its KV and recurrent state come from the files.
    ``crash-before-rows``: A died after renaming its files but before their table rows were
    written (and left a torn temporary file): B adopts the files from their headers."""
    ref = builtin_pair[1]
    kw = dict(max_model_len=4096, kv_tokens=16384, dtype="float32", state_dir=tmp_path)
    session = make_session("opencode", 4, seed=5, output_lines=4, every=10)  # appends only
    a = LLM(builtin_model_dir, **kw)
    prompts = [
        a.tokenizer.encode(
            a.chat_template.render(session.messages(t), tools=TOOLS, add_generation_prompt=True)
        )
        for t in range(4)
    ]
    for p in prompts[:3]:
        serve(a, [p])
    report = a.close()
    assert report.files >= 1 and report.bytes > 0
    spilled = list((tmp_path / "snapshots").rglob("*.safetensors"))
    assert len(spilled) == report.files
    if rows_lost:
        with Store(tmp_path) as store:
            fingerprint = spilled[0].parent.name
            for rec in store.anchors(fingerprint):
                store.delete_anchor(fingerprint, rec.prefix_hash)
            assert store.anchors(fingerprint) == []
        torn = spilled[0].with_suffix(".tmp")
        torn.write_bytes(b"half a file")
        long_ago = time.time() - 3600
        os.utime(torn, (long_ago, long_ago))
        fresh = spilled[0].with_name("another-daemon-writing.tmp")
        fresh.write_bytes(b"half a file")

    b = LLM(builtin_model_dir, **kw)
    assert b.engine.prefix.spill.adopted == (report.files if rows_lost else 0)
    assert len(b.engine.prefix.spill.records) == report.files
    [(out, cached)] = serve(b, [prompts[3]])
    assert cached == len(prompts[2])  # resumes at the end of the last prompt it saw before
    assert b.engine.prefix.spill.loaded == 1
    if rows_lost:
        assert not torn.exists() and fresh.exists()
    assert out == serve(ref, [prompts[3]])[0][0]
    b.close()

    # another KV layout is another engine configuration: its files are not even candidates
    c = LLM(builtin_model_dir, page_size=32, **kw)
    assert serve(c, [prompts[3]])[0][1] == 0 and c.engine.prefix.spill.records == {}
    c.close()

    # a damaged file is dropped with a warning, never fatal
    for f in (tmp_path / "snapshots").rglob("*.safetensors"):
        f.write_bytes(f.read_bytes()[:100])
    d = LLM(builtin_model_dir, **kw)
    before = len(d.engine.prefix.spill.records)
    [(out, cached)] = serve(d, [prompts[3]])
    assert cached == 0 and out == serve(ref, [prompts[3]])[0][0]
    assert d.engine.prefix.spill.loaded == 0 and len(d.engine.prefix.spill.records) < before
    d.close()


def test_a_failing_spill_write_costs_the_file_not_the_engine(
    builtin_model_dir, tmp_path, monkeypatch, caplog
):
    """A full disk while spilling: the snapshot is not written, nothing is recorded, the engine
    keeps serving, and a later spill (disk freed) writes it."""
    import freetokend.kv.spill as spill_mod

    llm = LLM(builtin_model_dir, max_model_len=4096, kv_tokens=16384, dtype="float32",
              state_dir=tmp_path)  # fmt: skip
    session = make_session("opencode", 2, seed=3, output_lines=4, every=10)
    prompts = [
        llm.tokenizer.encode(
            llm.chat_template.render(session.messages(t), tools=TOOLS, add_generation_prompt=True)
        )
        for t in range(2)
    ]
    serve(llm, [prompts[0]])

    tries = []

    def disk_full(*args, **kwargs):
        tries.append(1)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(spill_mod, "save_file", disk_full)
    prefix, engine = llm.engine.prefix, llm.engine
    engine.spill_idle_s = 0.0
    assert prefix.unspilled()
    engine.idle()
    assert tries and prefix.spill.records == {} and "No space left" in caplog.text
    assert not list((tmp_path / "snapshots").rglob("*.safetensors"))
    attempts = len(tries)
    engine.idle()
    engine.idle()
    assert len(tries) == attempts  # not retried until the engine has worked again
    assert serve(llm, [prompts[1]])[0][1] > 0  # still serving, still reusing
    engine.idle()
    assert len(tries) > attempts
    monkeypatch.undo()
    assert llm.close().files >= 1
