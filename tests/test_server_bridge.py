"""The engine bridge and Generation in-process, over a scripted fake engine and the built-in
model's real tokenizer: ordering, stop strings, EOS text, aborts, engine failures, limits."""

from __future__ import annotations

import asyncio

import pytest
from server_support.daemon import state_dir
from server_support.fake_engine import FakeEngine

from freetokend.engine.sampler import SamplingParams
from freetokend.engine.tokenizer import Tokenizer
from freetokend.models.builtin import ensure_builtin_model
from freetokend.server.bridge import EngineBridge, Submission
from freetokend.server.errors import InvalidRequest, Overloaded
from freetokend.server.generation import Generation
from freetokend.server.metrics import Metrics
from freetokend.server.parsers.base import Content, PassThrough


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_dir(ensure_builtin_model(state_dir()))


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


async def start(engine: FakeEngine, cap: tuple[int, int] = (4, 4)):
    metrics = Metrics()
    bridge = EngineBridge(engine, cap[0], cap[1], metrics)
    bridge.start(asyncio.get_running_loop())
    return bridge, metrics


def generation(bridge, metrics, tok, rid, prompt, stop=(), max_tokens=32) -> Generation:  # type: ignore[no-untyped-def]
    handle = bridge.submit(Submission(rid, [prompt], SamplingParams(max_tokens=max_tokens), None))
    return Generation(
        bridge=bridge,
        handle=handle,
        tokenizer=tok,
        parser=PassThrough(),
        stop=list(stop),
        stop_token_ids=set(bridge.engine.eos),
        skip_special_tokens=True,
        want_logprobs=True,
        metrics=metrics,
    )


def test_text_usage_and_eos_not_in_text(tok):
    eos = tok.token_to_id("<|im_end|>")
    ids = tok.encode("Hello world!")
    engine = FakeEngine({"1": [*ids, eos]}, eos)

    async def main():
        bridge, metrics = await start(engine)
        gen = generation(bridge, metrics, tok, "a", 1)
        text, events, lps = await gen.collect()
        gen.close()
        bridge.stop()
        return gen, text, events, lps, bridge

    gen, text, events, lps, bridge = run(main())
    assert text == "Hello world!"
    assert all(isinstance(e, Content) for e in events)
    assert "".join(e.text for e in events) == text
    assert gen.finish_reason == "stop" and gen.usage.completion_tokens == len(ids) + 1
    assert gen.usage.cached_tokens == 1 and len(lps) == len(ids)  # no logprob for the EOS
    assert bridge.in_flight == 0


def test_stop_string_across_tokens_aborts_the_engine_request(tok):
    eos = tok.token_to_id("<|im_end|>")
    # the script's end waits for the abort: the stop string must cause it, not race it
    engine = FakeEngine({"1": tok.encode("one two STOP three four")}, eos, until_aborted={"1"})

    async def main():
        bridge, metrics = await start(engine)
        gen = generation(bridge, metrics, tok, "a", 1, stop=["ST", "OP th"])
        text, _, _ = await gen.collect()
        gen.close()
        bridge.stop()
        return gen, text

    gen, text = run(main())
    assert text == "one two " and gen.stop_sequence == "ST" and gen.finish_reason == "stop"
    assert engine.aborted == ["a"]


def test_concurrent_requests_and_abort_of_one(tok):
    eos = tok.token_to_id("<|im_end|>")
    scripts = {"1": tok.encode("aaaa bbbb"), "2": tok.encode("cccc dddd eeee")}
    engine = FakeEngine(scripts, eos, until_aborted={"2"})  # "b" ends only by its abort

    async def main():
        bridge, metrics = await start(engine)
        g1 = generation(bridge, metrics, tok, "a", 1)
        g2 = generation(bridge, metrics, tok, "b", 2)
        first = await g2.chunks().__anext__()
        g2.close()  # the client left
        text1, _, _ = await g1.collect()
        g1.close()
        bridge.stop()
        return first, text1, metrics, bridge

    first, text1, metrics, bridge = run(main())
    assert text1 == "aaaa bbbb" and first.text
    assert engine.aborted == ["b"] and metrics.aborted == 1 and bridge.in_flight == 0


def test_engine_failure_fails_the_request_not_the_thread(tok):
    eos = tok.token_to_id("<|im_end|>")
    engine = FakeEngine({"1": tok.encode("xyz"), "2": tok.encode("ok")}, eos)

    async def main():
        bridge, metrics = await start(engine)
        engine.fail_next_step = True
        g = generation(bridge, metrics, tok, "a", 1)
        with pytest.raises(RuntimeError, match="boom"):
            await g.collect()
        g.close()
        again = generation(bridge, metrics, tok, "b", 2)  # the thread still serves
        text, _, _ = await again.collect()
        again.close()
        bridge.stop()
        return text

    assert run(main()) == "ok"


def test_capacity_and_context_errors(tok):
    eos = tok.token_to_id("<|im_end|>")
    engine = FakeEngine({"1": tok.encode("a b c d e f")}, eos, max_model_len=20)
    engine.step_delay.clear()  # hold the engine so requests stay in flight

    async def main():
        bridge, metrics = await start(engine, cap=(1, 1))
        with pytest.raises(InvalidRequest, match="exceeds the context"):
            generation(bridge, metrics, tok, "big", 1, max_tokens=30)
        g1 = generation(bridge, metrics, tok, "a", 1, max_tokens=8)
        g2 = generation(bridge, metrics, tok, "b", 1, max_tokens=8)
        with pytest.raises(Overloaded) as e:
            generation(bridge, metrics, tok, "c", 1, max_tokens=8)
        assert e.value.headers["Retry-After"] == "1"
        g2.close()
        g3 = generation(bridge, metrics, tok, "d", 1, max_tokens=8)  # a freed slot is usable again
        engine.step_delay.set()
        for g in (g1, g3):
            await g.collect()
            g.close()
        bridge.stop()
        return bridge

    assert run(main()).in_flight == 0
