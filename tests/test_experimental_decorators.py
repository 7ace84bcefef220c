"""utils.experimental_fn / experimental_cls (Megatron-Core's decorator factories) and HAVE_PACKAGING."""

from __future__ import annotations

from unittest.mock import patch

import pytest

from megatron_core import config, utils


@utils.experimental_cls(introduced_with_version="0.1.0")
class _Exp:
    def value(self):
        return 1


@utils.experimental_fn(introduced_with_version="0.1.0")
def _exp_fn(x):
    return x + 1


def test_experimental_class_and_function_need_the_flag():
    with patch.object(config, "ENABLE_EXPERIMENTAL", False):
        with pytest.raises(utils.ExperimentalNotEnabledError):
            _Exp()
        with pytest.raises(utils.ExperimentalNotEnabledError):
            _exp_fn(1)
    with patch.object(config, "ENABLE_EXPERIMENTAL", True):
        obj = _Exp()
        assert obj.value() == 1 and obj.is_experimental is True and _exp_fn(1) == 2


def test_have_packaging():
    assert utils.HAVE_PACKAGING is True
