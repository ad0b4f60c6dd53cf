"""A VJP returns each gradient in its primal's dtype (checks.check_gradient_dtypes):
a bf16 parameter's gradient returned in f32 passes every value bound, so the dtype is
checked on its own."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from pallascheck.properties import checks

CONTEXT = checks.Context(kernel="k", dtype="bfloat16", backend="interpret")
PRIMALS = {
    "x": np.ones((2, 3), ml_dtypes.bfloat16),
    "scale": np.ones(3, ml_dtypes.bfloat16),
    "cotangent": np.ones((2, 3), ml_dtypes.bfloat16),
}


def test_gradients_in_their_primals_dtypes_pass() -> None:
    grads = {"dx": np.zeros((2, 3), ml_dtypes.bfloat16), "dscale": np.zeros(3, ml_dtypes.bfloat16)}
    assert checks.check_gradient_dtypes(grads, PRIMALS, context=CONTEXT).passed


def test_a_gradient_in_another_dtype_fails_naming_it() -> None:
    grads = {"dx": np.zeros((2, 3), ml_dtypes.bfloat16), "dscale": np.zeros(3, np.float32)}
    with pytest.raises(checks.CheckFailure, match="dscale is float32, its primal scale is bfloat16"):
        checks.check_gradient_dtypes(grads, PRIMALS, context=CONTEXT)
