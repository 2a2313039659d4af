"""OLMoE: q/k RMSNorm over the whole projection, optional QKV clipping, softmax top-k router
without renormalisation by default."""

from .spec import FamilySpec, GgufRules, HfRules

SPEC = FamilySpec(
    architectures=("OlmoeForCausalLM",),
    hf=HfRules(fixed={"qk_norm": "full"}),
    gguf=GgufRules(arch="olmoe", experts_key="num_experts", norm_topk=False),
    renames=((r"\.mlp\.gate\.weight$", ".mlp.router.weight"),),
)
