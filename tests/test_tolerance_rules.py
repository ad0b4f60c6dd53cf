"""``pallascheck bench --tolerance-rules``: the four rules judge the same inputs, and the
contract-only variant shows how they differ (the implementation bound passes it, the
contract does not)."""
from __future__ import annotations

from broken import loss_variants

from pallascheck.bench import tolerance_rules
from pallascheck.kernels.backends import Backend


def test_rules_tell_a_contract_only_variant_apart() -> None:
    spec, _, examples = loss_variants.VARIANTS["lse_minus_target"]
    result = tolerance_rules.judge("lse_minus_target", spec, ("float32",), Backend("interpret"), examples, 0,
                                   broken=True)
    assert result.caught["contract"] and not result.caught["implementation"], result
    summary = tolerance_rules.summary([result])
    assert summary["contract"]["kills"] == 1 and summary["implementation"]["misses"] == 1
