"""The offline API: ``LLM(model_dir).generate(...)`` and ``.chat(...)``.

The daemon builds the same object and drives its ``engine`` (an EngineCore) from a thread.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import tempfile
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, overload

import torch

from ..config import MOE_BACKENDS
from ..experts import accelerator as accelerators
from ..experts import cpu_executor
from ..experts.accelerator import Accelerator
from ..experts.backend import (
    CpuBackend,
    RoutingRecorder,
    SlotBudget,
    create_backend,
    moe_activation_bytes,
    resolve_backend,
)
from ..experts.banks import ActivationSpec, activation_of
from ..formats.gguf_file import GgufFile, set_name, split_files
from ..kv.spill import SnapshotSpill, engine_fingerprint
from ..models.config import ModelConfig
from ..models.dense_quant import PRESETS, expert_format, quantize_dense
from ..models.expert_quant import quantize_experts_at_load
from ..models.hugepages import back_with_huge_pages, weight_tensors
from ..models.loader import load_model, model_config, model_kind
from ..models.model import decode_attention_bytes, kv_bytes_per_token
from ..models.registry import family_spec
from ..native import dense_native
from ..store import Store
from .chat_template import ChatTemplate
from .core import NO_TOKEN, EngineCore
from .gguf_tokenizer import chat_template_from_gguf, tokenizer_from_gguf
from .graphs import BATCH_BUCKETS, DecodeGraphs, graphs_blocker, width_for
from .placement import (
    HOST,
    Placement,
    dense_device_bytes,
    device_snapshot_bytes,
    kv_tokens_for,
    place_dense,
)
from .prefix import PrefixReuse, SnapshotPolicy
from .runner import ModelRunner, Work
from .sampler import SamplingParams
from .tokenizer import Tokenizer

log = logging.getLogger(__name__)

_DEFAULT_KV_TOKENS = 131072


def _slot_budget(
    model: Any,
    cfg: ModelConfig,
    step_tokens: int,
    kv_tokens: int,
    snapshot_bytes: int,
    attention_bytes: int = 0,
) -> SlotBudget:
    """What the default slot count leaves free on the device: the KV pool (K + V of every
    attention layer per token, allocated after the slots), one step's MoE activations, the
    recurrent-state snapshots' budget when they live there and decode attention's work
    buffers (``attention_bytes``)."""
    kv = kv_bytes_per_token(model)
    act = moe_activation_bytes(step_tokens, cfg.top_k, cfg.hidden_size, cfg.moe_intermediate_size)
    return SlotBudget(
        kv_reserve_tokens=kv_tokens,
        kv_bytes_per_token=kv,
        activation_bytes=act + snapshot_bytes,
        attention_bytes=attention_bytes,
    )


def _context_limit(max_model_len: int | None, cfg: ModelConfig, kv_tokens: int) -> int:
    """The longest context served: ``max_model_len`` (default: the model's, bounded by the KV
    pool), never above the model's."""
    limit = min(max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
    return limit if max_model_len is not None else min(limit, kv_tokens)


def _decode_keys(max_len: int, page_size: int) -> int:
    """Keys of the widest page table a decode step of a ``max_len`` context runs over: the
    eager static step's power-of-two width (engine/graphs.width_for; graphs are no wider)."""

    return width_for(-(-max_len // page_size)) * page_size


def _enter_fake_device(accelerator: str, vram_mib: int | None) -> Any:
    """The entered ``FakeCudaAccelerator`` for ``accelerator="fake-cuda"``, else None."""
    if accelerator != "fake-cuda":
        return None
    acc = accelerators.create_accelerator("fake-cuda", vram_mib=vram_mib)
    acc.open()  # type: ignore[attr-defined]  # the modes: per thread, see LLM._device_scope
    return acc


class LLM:
    """A loaded model with its tokenizer, chat template and engine.

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
                 prefill about 1.6x the fp32-activation kernels, decode about the same; those
                 run where the CPU lacks it (logged) and with ``cpu_bf16_dot=False``
    huge_pages   with the ``cpu`` backend, the weights collapsed into 2 MiB transparent huge
                 pages after load (models/hugepages.py: fewer TLB misses in the weight streams
                 of every token; where the kernel refuses, logged and left as they are)
    """

    def __init__(
        self,
        model_dir: str | Path,
        moe_backend: str = "cpu",
        *,
        max_model_len: int | None = None,
        kv_tokens: int | None = None,
        page_size: int = 16,
        max_batch: int = 32,
        max_step_tokens: int = 512,
        threads: int | None = None,
        moe_slots: int | None = None,
        accelerator: str = "auto",
        vram_mib: int | None = None,
        bandwidth: tuple[float, float] | None = None,
        record_routing: str | Path | None = None,
        dtype: str | None = None,
        prefix_cache: bool = True,
        snapshot_policy: str = "anchors",
        snapshot_budget_mb: float = 256,
        state_dir: str | Path | None = None,
        spill_budget_mb: float = 2048,
        spill_idle_s: float = 2.0,
        name: str | None = None,
        quantize_experts: str | None = None,
        quantize: str | None = None,
        cuda_graphs: bool = False,
        cpu_bf16_dot: bool = True,
        huge_pages: bool = True,
    ) -> None:
        if moe_backend not in MOE_BACKENDS:
            raise ValueError(
                f"unknown moe_backend {moe_backend!r}; choose one of {', '.join(MOE_BACKENDS)}"
            )
        if (accelerator == "fake-cuda") != (vram_mib is not None):
            raise ValueError("vram_mib (the simulated card) goes with accelerator 'fake-cuda'")
        self.model_dir = Path(model_dir)
        # a GGUF file (or split set): config, tokenizer and template all come from its metadata
        self.gguf = model_kind(self.model_dir) == "gguf"
        self._gguf_has_tokens: bool | None = None
        self._tokenizer_json: Path | None = None
        if self.gguf:
            self.name = name or set_name(self.model_dir)
        else:
            self.name = name or self.model_dir.name
        if dtype is not None and dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
        cfg = model_config(self.model_dir, dtype)
        self.model, self.banks = load_model(self.model_dir, cfg)
        if quantize is not None:  # a preset: dense layers and experts (models/dense_quant.py)
            if quantize not in PRESETS:
                raise ValueError(f"quantize: {quantize!r} is not one of {', '.join(PRESETS)}")
            if quantize_experts is not None:
                raise ValueError("give quantize (a preset) or quantize_experts, not both")
            quantize_dense(self.model, quantize)
            if self.banks.format == "bf16":
                quantize_experts = expert_format(
                    quantize, cfg.hidden_size, cfg.moe_intermediate_size
                )
        if quantize_experts is not None:
            self.banks = quantize_experts_at_load(self.banks, cfg, quantize_experts)
        if self.banks.format != cfg.expert_format:  # quantized here, or in an FTW conversion
            cfg = dataclasses.replace(cfg, expert_format=self.banks.format)
        self.config = cfg
        act = ActivationSpec(activation_of(cfg.activation), cfg.swiglu_alpha, cfg.swiglu_limit)
        # the fake device: entered after the host weights are loaded (they stay real tensors)
        self.fake_device = _enter_fake_device(accelerator, vram_mib)
        try:
            with self._device_scope():
                # order on a device: dense weights, then the KV pool's size from what they
                # leave, then the expert slots from what is left after both (engine/placement)
                backend = resolve_backend(moe_backend, self.fake_device or accelerator, bandwidth)
                self.placement = self._place(backend, accelerator)
                kv = kv_tokens_for(
                    kv_tokens, kv_bytes_per_token(self.model), self.placement.acc,
                    _DEFAULT_KV_TOKENS,
                )  # fmt: skip
                snapshots = device_snapshot_bytes(
                    self.model, int(snapshot_budget_mb * 2**20), self.placement.on_device
                )
                # Default context: the model's, bounded by the KV pool (default 131072 tokens
                # on the host, where pages are committed only when written; on a card, its
                # share of VRAM). Agents ask for max_tokens 32000 on top of long prompts.
                self.max_model_len = _context_limit(max_model_len, cfg, kv)
                self.slot_budget = self._budget(kv, snapshots, max_step_tokens, max_batch,
                                                page_size)  # fmt: skip
                self.cpu_isa = _cpu_isa(cpu_bf16_dot, threads)
                self.moe = self._backend(backend, act, moe_slots, bandwidth, threads)
                if huge_pages and isinstance(self.moe, CpuBackend):  # the CPU streams them
                    back_with_huge_pages(weight_tensors(self.model, self.moe.banks))
                if record_routing is not None:
                    self.moe = RoutingRecorder(self.moe, record_routing)
                self.runner = ModelRunner(self.model, self.moe, kv, page_size, self.placement)
                if self.placement.on_device:
                    log.info(
                        "placement: dense weights %d MiB, KV pool %d tokens (%d MiB) on %s",
                        dense_device_bytes(self.model) >> 20, kv, self.runner.kv.nbytes >> 20,
                        self.placement.device,
                    )  # fmt: skip
        except BaseException:
            self._exit_fake_device()
            raise
        if cuda_graphs:
            self._capture_graphs(backend)
        self._tokenizer: Any = None
        self._chat_template: Any = None
        prefix = None
        if prefix_cache:
            policy = SnapshotPolicy.parse(
                snapshot_policy, self._anchor_ids() if snapshot_policy.startswith("anchors") else {}
            )
            prefix = PrefixReuse(
                self.runner.kv,
                self.model.num_linear_layers > 0,
                policy,
                int(snapshot_budget_mb * 2**20),
            )
        self.engine = EngineCore(
            self.runner,
            self._eos_ids(),
            self.max_model_len,
            max_batch,
            max_step_tokens,
            prefix=prefix,
            spill_idle_s=spill_idle_s,
        )
        self.engine.device_scope = self._device_scope
        self._ids = itertools.count()
        self._store: Any = None
        if state_dir is not None and prefix is not None and prefix.snapshots is not None:
            self._attach_spill(prefix, Path(state_dir), spill_budget_mb)

    def _attach_spill(self, prefix: PrefixReuse, state_dir: Path, budget_mb: float) -> None:

        self._store = Store(state_dir)
        fp = engine_fingerprint(
            self.model_dir, self.config.torch_dtype, self.runner.kv, self.config.expert_format
        )
        prefix.spill = SnapshotSpill(self._store, fp, int(budget_mb * 2**20))
        assert prefix.snapshots is not None
        prefix.snapshots.keep_prefix = True

    def _capture_graphs(self, backend: str) -> None:
        """``cuda_graphs``: decode graphs per batch bucket (engine/graphs.py), captured now;
        where they cannot be, one log line says why and decode runs eagerly."""

        blocker = graphs_blocker(backend, self.placement.device, self.model)
        if blocker is not None:
            log.info("cuda graphs: off (%s); decode runs without graphs", blocker)
            return
        graphs = DecodeGraphs(self.runner, self.runner.kv.pages_for(self.max_model_len))
        with self._device_scope():
            if graphs.capture_all():
                self.runner.graphs = graphs

    def _place(self, backend: str, accelerator: str) -> Placement:
        """The host for the cpu backend; else the dense part moves to the accelerator (raises
        ``DenseDoesNotFit`` with the numbers when it cannot)."""
        if backend == "cpu":
            return HOST
        # looked up at call time, as create_backend does (tests swap in a chaos-order stand-in)
        acc: Accelerator = self.fake_device or accelerators.create_accelerator(accelerator)
        return place_dense(self.model, acc)

    def _budget(
        self, kv_tokens: int, snapshots: int, step_tokens: int, max_batch: int, page_size: int
    ) -> SlotBudget:
        """The slot budget: on a device, the KV pool (allocated after the slots) and decode
        attention's work buffers at the widest decode batch (the engine's, or the largest graph
        bucket with its padding rows) over the longest context."""

        on_device = self.placement.on_device
        rows = max(max_batch, *BATCH_BUCKETS)
        keys = _decode_keys(self.max_model_len, page_size)
        attn = decode_attention_bytes(self.model, rows, keys, page_size) if on_device else 0
        return _slot_budget(self.model, self.config, step_tokens,
                            kv_tokens if on_device else 0, snapshots, attn)  # fmt: skip

    def _backend(  # type: ignore[no-untyped-def]
        self, name, act, moe_slots, bandwidth, threads
    ) -> Any:
        cfg = self.config
        acc = self.placement.acc
        return create_backend(
            name,
            self.banks,
            cfg.num_moe_layers,
            cfg.num_experts,
            act,
            accelerator=acc if acc is not None else (self.fake_device or "standin"),
            moe_slots=moe_slots,
            bandwidth=bandwidth,
            threads=threads,
            cpu_isa=self.cpu_isa,
            slot_budget=self.slot_budget,
        )

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
                self._tokenizer = tokenizer_from_gguf(self.model_dir)
            else:
                self._tokenizer = Tokenizer.from_dir(self.model_dir)
        return self._tokenizer

    @property
    def chat_template(self) -> Any:
        if self._chat_template is None:
            if self.gguf:
                self._chat_template = chat_template_from_gguf(self.model_dir)
            else:
                self._chat_template = ChatTemplate.from_dir(self.model_dir)
        return self._chat_template

    @property
    def tokenizer_json(self) -> Path:
        """A ``tokenizer.json`` for this model (for a GGUF: the converted tokenizer, written once
        to a temporary file), for consumers that read the file (constrained decoding)."""
        if not self.gguf:
            return self.model_dir / "tokenizer.json"
        if self._tokenizer_json is None:
            d = Path(tempfile.mkdtemp(prefix="freetoken-gguf-tok-"))
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

    def _eos_ids(self) -> set[int]:
        ids = set(self.config.eos_token_ids)
        if self._has_tokenizer():
            ids |= set(self.tokenizer.eos_token_ids)
        return ids

    def _has_tokenizer(self) -> bool:
        if self.gguf:  # the first file of a split set holds the metadata
            if self._gguf_has_tokens is None:
                with GgufFile(split_files(self.model_dir)[0]) as f:
                    self._gguf_has_tokens = "tokenizer.ggml.tokens" in f.metadata
            return self._gguf_has_tokens
        return (self.model_dir / "tokenizer.json").exists()

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


def _cpu_isa(bf16_dot: bool, threads: int | None) -> str:
    """The CPU kernels' path for ``cpu_bf16_dot``: "avx512bf16" (the dense pool configured for
    it too, process-wide) where the CPU has AVX512-BF16, else "auto" (logged when asked for); on
    "auto" the dense pool leaves "avx512bf16" if an earlier model of this process put it there."""

    if not dense_native.available():
        return "auto"
    if bf16_dot and "avx512bf16" in cpu_executor.supported_isas():
        dense_native.configure(threads, isa="avx512bf16")
        log.info("cpu_bf16_dot: bf16 weights on vdpbf16ps (activations rounded to bf16)")
        return "avx512bf16"
    if bf16_dot:
        log.info(
            "cpu_bf16_dot: this CPU lacks AVX512-BF16 (runs %s); the fp32-activation kernels run",
            ", ".join(cpu_executor.supported_isas()) or "no native kernels",
        )
    if dense_native.configured_isa() == "avx512bf16":
        dense_native.configure(threads, isa="auto")
    return "auto"
