"""Work before admission is bounded (issue 15, items 1 and 5): grammar compiles have a time
limit and a capped cache; requests being prepared (rendered, tokenized) count against the
daemon's capacity, count_tokens included, so a full daemon refuses before doing the work."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest
from server_support.daemon import state_dir
from server_support.fake_engine import FakeEngine

from freetokend.models.builtin import ensure_builtin_model
from freetokend.server.bridge import EngineBridge
from freetokend.server.chat import ChatRequest, Sampling
from freetokend.server.errors import Overloaded
from freetokend.server.service import ModelService


@pytest.fixture(scope="module")
def grammars():
    from freetokend.engine.tokenizer import Tokenizer
    from freetokend.server.constrained.constraint import GrammarFactory

    model = ensure_builtin_model(state_dir())
    tok = Tokenizer.from_dir(model)
    return GrammarFactory(model / "tokenizer.json", tok.vocab_size, sorted(tok.eos_token_ids))


def test_grammar_compile_has_a_time_limit_and_a_capped_cache(grammars):
    from freetokend.server.constrained import constraint

    assert grammars._compiler.cache_limit_bytes == constraint.CACHE_LIMIT_BYTES > 0
    grammars.timeout_s = 0.05
    release = threading.Event()
    started = time.monotonic()
    with pytest.raises(ValueError, match="did not compile within"):
        grammars._timed(release.wait, 60)  # a compile that would take 60 s
    assert time.monotonic() - started < 30  # the 0.05 s limit, not the compile's 60 s
    release.set()
    grammars.timeout_s = constraint.COMPILE_TIMEOUT_S
    assert grammars.json_schema({"type": "object"}) is not None  # the workers are free again


def _service(capacity: int) -> tuple[ModelService, EngineBridge]:
    """A ModelService over a FakeEngine bridge whose render blocks until released."""
    bridge = EngineBridge(FakeEngine({}, eos=0), capacity, 0, metrics=None)
    svc = ModelService.__new__(ModelService)
    svc.bridge, svc._preparing = bridge, 0
    svc.gate = threading.Event()

    def render(req):  # type: ignore[no-untyped-def]
        svc.gate.wait(10)
        return SimpleNamespace(ids=[1, 2, 3])

    svc.render = render  # type: ignore[method-assign]
    return svc, bridge


def test_requests_being_prepared_count_against_capacity():
    svc, _ = _service(capacity=2)
    req = ChatRequest(messages=[{"role": "user", "content": "x"}], sampling=Sampling(None))

    async def main() -> None:
        first = asyncio.ensure_future(svc.count_tokens(req))
        second = asyncio.ensure_future(svc.count_tokens(req))
        await asyncio.sleep(0.05)  # both are rendering now, holding both places
        with pytest.raises(Overloaded):
            await svc.count_tokens(req)
        svc.gate.set()
        assert await first == 3 and await second == 3
        assert svc._preparing == 0
        assert await svc.count_tokens(req) == 3  # places come back

    asyncio.run(main())
