"""What a model family declares, in one object: ``FamilySpec``.

Each module under ``families/`` defines ``SPEC = FamilySpec(...)``; ``models.registry`` finds
them. The generic code reads only these fields: ``config_hf.from_dict`` the ``hf`` rules,
``gguf_config`` / ``gguf_arch`` / ``gguf_loader`` the ``gguf`` rules, the weight loader the
renames, ignores and converters, the engine the anchors, the server's parser registry the
output syntax. A field's default is what a family without that feature needs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from ..config import ModelConfig
    from ..gguf_read import Fix, GgufMeta, Target

# (config, our parameter name after renames, tensor) -> [(our parameter name, tensor), ...]
Converter = Callable[["ModelConfig", str, "torch.Tensor"], list[tuple[str, "torch.Tensor"]]]


@dataclass(frozen=True)
class HfRules:
    """How the family's config.json becomes a ModelConfig (``config_hf.from_dict``). ``text`` is
    the text model's dict (a multimodal wrapper's ``text_config``), after ``defaults``."""

    # what transformers assumes for a key config.json leaves out (only absent keys: an explicit
    # null stays)
    defaults: Mapping[str, Any] = field(default_factory=dict)
    # ModelConfig fields the family always has, whatever config.json says (router_kind,
    # qk_norm, norm_topk_prob when the router always renormalises, activation, ...)
    fixed: Mapping[str, Any] = field(default_factory=dict)
    # multi-head latent attention: the head is qk_nope + qk_rope, the LoRA ranks are read
    mla: bool = False
    # the grouped router's n_group / topk_group / routed_scaling_factor are read, and the router
    # runs in fp32
    grouped_router: bool = False
    # "none"; "gated": one shared expert of shared_expert_intermediate_size behind a sigmoid
    # gate; "plain": n_shared_experts experts of moe_intermediate_size fused into one, no gate
    shared_expert: str = "none"
    # norm_topk_prob when config.json leaves it out
    norm_topk_default: bool = False
    # partial_rotary_factor when config.json gives neither it nor rotary_dim
    partial_rotary_default: float = 1.0
    # (text, n) -> layer_types when config.json has none (None: sliding where sliding_window
    # and use_sliding_window are set, else full attention)
    layer_types: Callable[[dict[str, Any], int], list[str]] | None = None
    # (text, n, source) -> per layer, whether its FFN is the routed MoE (None: every layer)
    moe_layers: Callable[[dict[str, Any], int, str], tuple[bool, ...]] | None = None
    # (text, source) -> text: the family's spellings of the shared keys, and what is refused
    normalize: Callable[[dict[str, Any], str], dict[str, Any]] | None = None
    # (text, config, source) -> ModelConfig fields to replace, for what depends on the config
    fields: Callable[[dict[str, Any], ModelConfig, str], dict[str, Any]] | None = None


@dataclass(frozen=True)
class GgufJoin:
    """Block tensors read together into one parameter (DeepSeek's split kv_b)."""

    parts: tuple[str, ...]  # the block keys, in the order ``join`` takes them
    target: str  # our parameter under ``layers.N.``
    unless: str  # a block key that, when the file has it, holds the parameter whole
    join: Callable[..., torch.Tensor]  # (config, *parts) -> the parameter


@dataclass(frozen=True)
class GgufRules:
    """How a llama.cpp GGUF file of the family is read (``gguf_config``, ``gguf_arch``): its
    metadata into config.json fields, its block tensors back into our parameters."""

    arch: str  # llama.cpp's general.architecture
    experts_key: str  # the config.json key that receives expert_count
    norm_topk: bool  # llama.cpp's default for expert_weights_norm
    # (metadata) -> more config.json fields (over the generic ones)
    metadata: Callable[[GgufMeta], dict[str, Any]] | None = None
    # the name also covers dense models: refuse a file without expert_count
    needs_experts: bool = False
    # head_count_kv per layer may differ (the metadata hook reads them; the first stands)
    kv_heads_vary: bool = False
    # block keys beyond (or replacing) the shared table: blk.N.<key> -> layers.N.<ours>
    block: Mapping[str, str] = field(default_factory=dict)
    # (config, block key) -> the transform undoing the converter's, or None
    block_fix: Callable[[ModelConfig, str], Fix | None] | None = None
    # (config, block key) -> the targets of a tensor that fills several parameters, or []
    # for one read with another (``joins``); None: the block table's one target
    block_split: Callable[[ModelConfig, str], list[Target] | None] | None = None
    # top-level tensors beyond the shared ones (token_embd, output_norm, output): GGUF name ->
    # our parameter
    top: Mapping[str, str] = field(default_factory=dict)
    # top-level tensors' transforms (GGUF name -> fix)
    top_fix: Mapping[str, Fix] = field(default_factory=dict)
    joins: tuple[GgufJoin, ...] = ()
    # our parameter -> the GGUF block key that fills it, for messages (where ``block`` does not
    # say: the parameters a split fills)
    message_keys: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class FamilySpec:
    # the module's name (set by the registry): ModelConfig.family
    name: str = ""
    # config.json ``architectures[0]`` values served by this family; the first is what a GGUF
    # file of the family reads as
    architectures: tuple[str, ...] = ()
    hf: HfRules = HfRules()
    gguf: GgufRules | None = None
    # "module:Class" under models/ of the family's own top level (a CausalLM subclass), where
    # the shared one does not serve; "" for CausalLM
    model: str = ""
    # the output syntax when the chat template does not reveal it (server/parsers/registry.py
    # ToolSyntax / ReasoningSyntax values)
    tool_syntax: str = "none"
    reasoning_syntax: str = "none"
    # (regex, replacement) applied in order to checkpoint names (prefix already stripped) to get
    # our parameter names.
    renames: tuple[tuple[str, str], ...] = ()
    # checkpoint tensors deliberately not loaded (regexes on the full checkpoint name)
    ignore: tuple[str, ...] = ()
    # multi-token-prediction tensors stored apart from the decoder layers (a regex on the full
    # checkpoint name, DeepSeek-V4's ``mtp.<i>.``): skipped, counted in one log line ("": only
    # those stored as layers after the last one, see ``fill.Filler.mtp``)
    mtp: str = ""
    # fused expert tensors stored as x @ W ([E, H, 2I] with gate/up interleaved, down [E, I, H]),
    # as GPT-OSS does; otherwise as W x ([E, 2I, H] gate rows then up rows, down [E, H, I]).
    experts_transposed_interleaved: bool = False
    # (regex on our name, converter): checkpoint tensors that split or reorder into our parameters
    converters: tuple[tuple[str, Converter], ...] = ()
    # semantic anchors (ARCHITECTURE §5.2): token string -> kind. A recurrent-state snapshot is
    # taken right after each such token; tokens the tokenizer does not have are ignored.
    anchors: tuple[tuple[str, str], ...] = ()
    # (the token that opens a turn, the text that ends the turn's header): the system prompt's
    # snapshot is taken after the next turn's header, where a compaction's new content starts
    turn_header: tuple[str, str] | None = None


# ChatML's turn header: <|im_start|>role\n
CHATML_TURN_HEADER = ("<|im_start|>", "\n")

# The ChatML markers of the Qwen families (and of the built-in model).
CHATML_ANCHORS = (
    ("<|im_end|>", "end_of_turn"),
    ("</think>", "end_of_thinking"),
    ("<tool_call>", "tool_call_start"),
    ("</tool_call>", "tool_call_end"),
    ("<tool_response>", "tool_output_start"),
    ("</tool_response>", "tool_output_end"),
)
