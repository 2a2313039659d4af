"""The offline API: ``LLM(model_dir).generate(...)`` and ``.chat(...)``.

The daemon builds the same object and drives its ``engine`` (an EngineCore) from a thread.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import tempfile
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, overload

import torch

from ..experts.backend import resolve_backend
from ..formats.gguf_file import GgufHeader
from ..models.registry import family_spec
from . import build
from .chat_template import ChatTemplate
from .core import NO_TOKEN
from .engine_config import EngineConfig
from .gguf_tokenizer import chat_template_from_gguf, tokenizer_from_gguf
from .runner import Work
from .sampler import SamplingParams
from .tiktoken_vocab import has_tiktoken_vocab
from .tokenizer import Tokenizer

log = logging.getLogger(__name__)


class LLM:
    """A loaded model with its tokenizer, chat template and engine.

    The settings below are ``EngineConfig``'s fields (engine/engine_config.py), given as
    keyword arguments or as one ``config=``; engine/build.py holds the construction steps.

    model_dir    HF checkpoint folder (config.json, safetensors, tokenizer files)
    moe_backend  cpu | fused | offload | hybrid | auto (ARCHITECTURE §4.5); every backend but cpu also
                 puts the dense weights, KV pool and sampling on the accelerator (placement.py)
    max_model_len  context limit (default: the model's, at most kv_tokens)
    kv_tokens    KV pool size in tokens over all sequences (default: 131072 with the cpu backend;
                 with fused/offload/hybrid the pool is on the accelerator, by default a quarter
                 of the memory the dense weights leave there, engine/placement.py)
    moe_slots    expert slots on the accelerator (offload / hybrid; default: what fits the device's
                 free memory, see ``SlotBudget``)
    accelerator  auto | standin (CPU stand-in, for tests) | cuda | fake-cuda (the real CUDA code
                 path on a simulated card of ``vram_mib`` MiB, no data: placement, device bytes
                 and host syncs are checked on a CPU machine, ARCHITECTURE §9.2; the fake session is
                 entered in this thread until ``close()``, and the tokens are meaningless)
    vram_mib     the simulated card of ``fake-cuda`` (required there, refused elsewhere)
    bandwidth    (B_P, B_H) in bytes/s for the hybrid q* split (default: the stored profile)
    record_routing  append every step's routed expert ids to this JSONL file (cache replay)
    dtype        weights' dtype in memory (default: the checkpoint's); float32 upcasts a bf16 model
    prefix_cache reuse KV (radix tree) and recurrent-state snapshots across requests
    snapshot_policy  anchors | anchors:all | interval:N | none (hybrid models: where recurrent state
                 is saved; see engine/prefix.SnapshotPolicy)
    snapshot_budget_mb  memory for recurrent-state snapshots (own LRU, apart from the KV pool)
    state_dir    spill snapshots (with their prefix KV) here on ``close()`` and resume from them
                 after a restart; metadata in the state store (hybrid models)
    spill_budget_mb  disk for spilled snapshots (least recently used files go first)
    spill_idle_s after this many idle seconds a serving loop calling ``engine.idle()`` writes
                 new session snapshots to disk (``close()`` writes the rest)
    quantize     q4_k_m | q8_0 | mxfp4: quantize a float checkpoint at load, dense layers to GGUF
                 blocks (native integer-dot kernels on the CPU) and experts, by the named mix
                 per tensor class of models/dense_quant.py; ``quantize_experts`` is the
                 experts-only form
    cuda_graphs  capture decode steps as CUDA graphs per batch bucket at load (engine/graphs.py;
                 a real GPU with fused or offload, else logged and eager)
    cpu_bf16_dot bf16 weights on the CPU (dense projections and bf16 experts) on vdpbf16ps where
                 the CPU has AVX512-BF16 (default on): activations rounded to bf16 as llama.cpp's
                 BF16 path and HF's bf16 forward do (the dense projections round them anyway);
                 prefill about 1.6x the fp32-activation kernels, decode about the same; the
                 fp32 kernels run where the CPU lacks it (logged) and with
                 ``cpu_bf16_dot=False``
    cpu_bf16_attention  with cpu_bf16_dot on such a CPU, the attention over a bf16 KV pool on
                 vdpbf16ps too (queries and softmax weights rounded to bf16; the prefill about
                 1.8x at 8k keys; decode rows on the same kernel, the same bits as in a prompt
                 chunk); default on, off for the fp32 kernels
    huge_pages   with the ``cpu`` backend, the weights collapsed into 2 MiB transparent huge
                 pages on a thread of its own once they are filled, beside the rest of the
                 start-up (models/hugepages.py: fewer TLB misses in the weight streams of every
                 token; where the kernel refuses, logged and left as they are)
    """

    def __init__(
        self,
        model_dir: str | Path,
        moe_backend: str = "cpu",
        *,
        config: EngineConfig | None = None,
        **kwargs: Any,
    ) -> None:
        """``config``, or its fields as keyword arguments (engine/engine_config.py), not both;
        the steps are engine/build.py's."""
        if config is None:
            config = EngineConfig.from_kwargs(kwargs)
        elif kwargs:
            raise TypeError("LLM() takes config or its fields as keyword arguments, not both")
        build.check(moe_backend, config)
        self.engine_config = config
        self.model_dir = Path(model_dir)
        self.gguf = build.is_gguf(self.model_dir)
        # a GGUF's headers, parsed once: config, weights, tokenizer and template read them
        self._gguf_headers: list[GgufHeader] = (
            build.gguf_headers(self.model_dir) if self.gguf else []
        )
        self._tokenizer_json: Path | None = None
        self.name = build.served_name(self.model_dir, self.gguf, config.name)
        self.config, self.model, self.banks = build.load(
            self.model_dir,
            config,
            self._gguf_headers or None,
            cpu_only=config.accelerator != "fake-cuda"
            and resolve_backend(moe_backend, config.accelerator, config.bandwidth) == "cpu",
        )
        # the fake device: entered after the host weights are loaded (they stay real tensors)
        self.fake_device = build.enter_fake_device(config.accelerator, config.vram_mib)
        try:
            with self._device_scope():
                parts = build.on_device(
                    self.model, self.banks, self.config, moe_backend, config, self.fake_device
                )
        except BaseException:
            self._exit_fake_device()
            raise
        self.placement, self.max_model_len = parts.placement, parts.max_model_len
        self.slot_budget, self.cpu_isa = parts.slot_budget, parts.cpu_isa
        self.moe, self.runner = parts.moe, parts.runner
        if config.cuda_graphs:
            build.capture_graphs(
                self.runner, self.model, parts.backend, self.max_model_len, self._device_scope
            )
        self._tokenizer: Any = None
        self._chat_template: Any = None
        prefix = build.prefix_reuse(
            self.runner, self.model, config, self._anchor_ids, self._turn_header
        )
        self.engine = build.engine_core(
            self.runner, self._eos_ids(), self.max_model_len, prefix, config,
            self._device_scope, parts.backend,
        )  # fmt: skip
        self._ids = itertools.count()
        self._store: Any = None
        if config.state_dir is not None and prefix is not None and prefix.snapshots is not None:
            self._store = build.attach_spill(
                prefix, Path(config.state_dir), config.spill_budget_mb, self.model_dir,
                self.config, self.runner,
            )  # fmt: skip

    def _device_scope(self) -> AbstractContextManager[Any]:
        """Device work of this engine in the calling thread: on ``fake-cuda`` the fake
        device's modes (torch keeps them per thread; the daemon steps from its engine
        thread), else nothing."""
        if self.fake_device is None:
            return contextlib.nullcontext()
        return self.fake_device.in_thread()  # type: ignore[no-any-return]

    def _exit_fake_device(self) -> None:
        if self.fake_device is not None:
            fake, self.fake_device = self.fake_device, None
            fake.close()

    def close(self) -> Any:
        """With a state_dir: spills the session snapshots to disk (returns the SpillReport) and
        closes the store; later requests no longer spill. On ``fake-cuda``: leaves the fake
        session (the engine can no longer step). Call it between steps; a second call does
        nothing."""
        if self._store is None:
            self._exit_fake_device()
            return None
        prefix = self.engine.prefix
        assert prefix is not None
        try:
            report = prefix.spill_now()
        finally:
            prefix.spill = None
            self._store.close()
            self._store = None
            self._exit_fake_device()
        return report

    # ---- tokenizer / template, loaded on first use ------------------------------------------
    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            if self.gguf:
                self._tokenizer = tokenizer_from_gguf(self.model_dir, self._gguf_metadata())
            else:
                self._tokenizer = Tokenizer.from_dir(self.model_dir)
        return self._tokenizer

    @property
    def chat_template(self) -> Any:
        if self._chat_template is None:
            if self.gguf:
                self._chat_template = chat_template_from_gguf(self.model_dir, self._gguf_metadata())
            else:
                self._chat_template = ChatTemplate.from_dir(self.model_dir)
        return self._chat_template

    @property
    def tokenizer_json(self) -> Path:
        """A ``tokenizer.json`` for this model (for a GGUF or a tiktoken rank file: the converted
        tokenizer, written once to a temporary file), for consumers that read the file
        (constrained decoding)."""
        if not self.gguf and not has_tiktoken_vocab(self.model_dir):
            return self.model_dir / "tokenizer.json"
        if self._tokenizer_json is None:
            d = Path(tempfile.mkdtemp(prefix="freetoken-tok-"))
            self.tokenizer.backend.save(str(d / "tokenizer.json"))
            self._tokenizer_json = d / "tokenizer.json"
        return self._tokenizer_json

    def _anchor_ids(self) -> dict[int, str]:
        """The family's anchor tokens that this tokenizer has (ARCHITECTURE §5.2)."""
        if not self._has_tokenizer():
            return {}
        out = {}
        for text, kind in family_spec(self.config.family).anchors:
            tid = self.tokenizer.token_to_id(text)
            if tid is not None:
                out[tid] = kind
        return out

    def _turn_header(self) -> tuple[int, int] | None:
        """The family's turn header (the token that opens a turn, the one that ends its header)
        when this tokenizer spells each as one token, else None."""
        header = family_spec(self.config.family).turn_header
        if header is None or not self._has_tokenizer():
            return None
        start = self.tokenizer.token_to_id(header[0])
        end = self.tokenizer.encode(header[1])
        if start is None or len(end) != 1:
            return None
        return start, end[0]

    def _eos_ids(self) -> set[int]:
        ids = set(self.config.eos_token_ids)
        if self._has_tokenizer():
            ids |= set(self.tokenizer.eos_token_ids)
        return ids

    def _gguf_metadata(self) -> dict[str, Any]:
        """The GGUF's metadata (the first file of a split set holds it), as parsed at load."""
        return self._gguf_headers[0].metadata

    def _has_tokenizer(self) -> bool:
        if self.gguf:
            return "tokenizer.ggml.tokens" in self._gguf_metadata()
        return (self.model_dir / "tokenizer.json").exists() or has_tiktoken_vocab(self.model_dir)

    # ---- scoring ----------------------------------------------------------------------------
    def logits(self, token_ids: list[int]) -> torch.Tensor:
        """Teacher-forced logits of the whole sequence at once: fp32 [T, vocab], row t scoring
        token t + 1 (for checks against other engines, perplexity, evaluation)."""
        if not token_ids:
            raise ValueError("logits() needs at least one token")
        if len(token_ids) > self.max_model_len:
            raise ValueError(f"{len(token_ids)} tokens exceed max_model_len {self.max_model_len}")
        vocab = self.config.vocab_size
        if any(not 0 <= t < vocab for t in token_ids):
            raise ValueError(f"token ids must be in [0, {vocab})")
        if self.engine.has_unfinished():
            raise RuntimeError("the engine is serving other requests; use the daemon's API")

        state = self.runner.new_state()
        try:
            with torch.no_grad():
                out = self.runner.forward([Work(state, list(token_ids), all_logits=True)])
        finally:
            self.runner.release(state)
        return self.runner.placement.fetch(out).float()

    # ---- generation -------------------------------------------------------------------------
    @overload
    def generate(
        self,
        prompt_token_ids: list[int],
        max_tokens: int,
        temperature: float = 0.0,
        ignore_eos: bool = False,
        **kw: Any,
    ) -> list[int]: ...

    @overload
    def generate(
        self,
        prompt_token_ids: list[list[int]],
        max_tokens: int,
        temperature: float = 0.0,
        ignore_eos: bool = False,
        **kw: Any,
    ) -> list[list[int]]: ...

    def generate(self, prompt_token_ids, max_tokens, temperature=0.0, ignore_eos=False, **kw):  # type: ignore[no-untyped-def]
        """Generated ids only (the prompt excluded; an end-of-sequence token is included).

        Pass one prompt (a list of ints) or a batch (a list of lists): the batch runs with
        continuous batching and returns one list per prompt, in order.
        """
        single = bool(prompt_token_ids) and isinstance(prompt_token_ids[0], int)
        prompts = [prompt_token_ids] if single else list(prompt_token_ids)
        params = SamplingParams(
            max_tokens=max_tokens, temperature=temperature, ignore_eos=ignore_eos, **kw
        )
        outs = self._run(prompts, params)
        return outs[0] if single else outs

    def _run(self, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
        if self.engine.has_unfinished():
            raise RuntimeError("the engine is serving other requests; use the daemon's API")
        rids = [f"offline-{next(self._ids)}" for _ in prompts]
        results: dict[str, list[int]] = {r: [] for r in rids}
        for rid, p in zip(rids, prompts, strict=True):
            self.engine.add_request(rid, list(p), params)
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.token_id != NO_TOKEN:
                    results[out.request_id].append(out.token_id)
        return [results[r] for r in rids]

    def chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        **sampling: Any,
    ) -> str:
        """Renders the chat template, generates, returns the decoded text (special tokens dropped)."""
        prompt = self.chat_template.render(messages, tools=tools, add_generation_prompt=True)
        ids = self.tokenizer.encode(prompt)
        params = SamplingParams(**{"max_tokens": 256, **sampling})
        out = self._run([ids], params)[0]
        if out and out[-1] in self.engine.eos and not params.ignore_eos:
            out = out[:-1]
        return self.tokenizer.decode(out, skip_special_tokens=True)
