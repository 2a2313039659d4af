"""OLMoE: q/k RMSNorm over the whole projection, optional QKV clipping, softmax top-k router
without renormalisation by default."""

from .spec import FamilySpec

SPEC = FamilySpec(renames=((r"\.mlp\.gate\.weight$", ".mlp.router.weight"),))
