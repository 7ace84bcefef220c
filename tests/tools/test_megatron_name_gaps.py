"""What ``tools/megatron_name_gaps.py`` counts as a module's public names (parsed source, no Megatron-LM needed)."""

from __future__ import annotations

import textwrap

from tools.megatron_name_gaps import public_names

_MODULE = textwrap.dedent('''
    """A module that defines and imports."""
    import torch
    from typing import Optional
    from megatron.core.utils import helper
    from .sibling import Thing as Alias
    try:
        from megatron.core.extensions.te import TEThing
    except ImportError:
        TEThing = None
    __all__ = ["Defined", "from_all_only"]
    LIMIT = 4
    _private = 1

    class Defined:
        pass

    def function():
        pass
''')

_ALIAS_MODULE = textwrap.dedent('''
    """An alias module: only imports."""
    from .contexts import StaticInferenceContext as InferenceParams
    from typing import Any
''')


def test_a_module_counts_its_definitions_and_its_all():
    assert public_names(_MODULE) == ["Defined", "LIMIT", "from_all_only", "function"]


def test_a_package_init_also_counts_what_it_imports_from_megatron():
    assert public_names(_MODULE, package_init=True) == ["Alias", "Defined", "LIMIT", "TEThing", "from_all_only",
                                                        "function", "helper"]


def test_an_import_only_module_counts_its_megatron_imports():
    assert public_names(_ALIAS_MODULE) == ["InferenceParams"]
