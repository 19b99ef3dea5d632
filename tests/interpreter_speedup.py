"""Triton's CPU interpreter without three of its per-operation costs (the kernel tests ran about twice as long).

1. Triton 3.6 patches `triton.language` (every builtin, found with `inspect.getmembers`) when a launch starts and
   restores it when the launch ends (`GridExecutor.__call__`), but also again on *every call of a @triton.jit helper
   inside a kernel* (`InterpretedFunction.__call__`): once per program and loop iteration for helpers such as
   `moe_int4._nibble` or `qsa._radix_prefix`. Inside a launch that patch changes nothing (the builtins are already
   replaced, and the replacements are not builtins, so the scan skips them), yet it took 30% of
   `tests/test_kernel_qsa.py` (py-spy, 2026-12-07). Skipped for helpers whose language modules the running launch
   has patched: the kernel's own (`tl`), and those a first call of a helper from another module patched (`tl.core`
   for triton.language.standard's `zeros`, `cumsum`, ...: Triton never undoes a device call's patch).
2. `_get_np_dtype` built its 19-entry table of numpy dtypes for every operation: answered from a table that
   Triton's own function fills.
3. A `block_type`, made for every operation's result, built its shape as a Triton tuple (typing each element) and
   its name from it: it copies the first one of its element type and shape instead (8.3 -> 0.9-2.9 us a type).

Everything else goes through Triton's own code. Tests only: the served model never runs the interpreter.
"""

from __future__ import annotations

import functools
import inspect


def _lang_modules(fn) -> frozenset[int]:
    """The `triton.language` modules in fn's globals, which Triton's `_patch_lang(fn)` patches (a rewrite adds the
    interpreter's globals to a module's: the count is part of the key)."""
    return _lang_modules_of(fn, len(fn.__globals__))


@functools.lru_cache(maxsize=None)
def _lang_modules_of(fn, _n_globals: int) -> frozenset[int]:
    import triton.language as tl

    return frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))


def install() -> None:
    """Replace the three (once a process; `conftest.py` calls it when TRITON_INTERPRET=1)."""
    from triton.runtime import interpreter as interp

    if getattr(interp.InterpretedFunction, "_moepipe_fast_calls", False):
        return
    launch_call = interp.GridExecutor.__call__
    device_call = interp.InterpretedFunction.__call__
    patched: list[set[int]] = []          # the lang modules each running launch has patched (launches nest)

    def launch(self, *args, **kwargs):
        patched.append(set(_lang_modules(self.fn)))
        try:
            return launch_call(self, *args, **kwargs)
        finally:
            patched.pop()

    def call(self, *args, **kwargs):
        langs = _lang_modules(self.fn)
        if not patched or not langs <= patched[-1]:
            if patched:          # Triton's call patches them (and never restores them): the rest of the launch may skip
                patched[-1] |= langs
            return device_call(self, *args, **kwargs)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:          # as Triton's own device call reports it
            raise interp.InterpreterError(repr(e)) from e

    import triton.language as tl

    np_dtype = interp._get_np_dtype
    scalar_dtypes: dict = {}

    def get_np_dtype(tt_dtype):
        if isinstance(tt_dtype, tl.block_type) and not isinstance(tt_dtype.element_ty, tl.pointer_type):
            tt_dtype = tt_dtype.element_ty
        if isinstance(tt_dtype, (tl.pointer_type, tl.block_type)):
            return np_dtype(tt_dtype)
        found = scalar_dtypes.get(tt_dtype)
        if found is None:
            found = scalar_dtypes[tt_dtype] = np_dtype(tt_dtype)
        return found

    interp._get_np_dtype = get_np_dtype
    _share_block_types()
    interp.GridExecutor.__call__ = launch
    interp.InterpretedFunction.__call__ = call
    interp.InterpretedFunction._moepipe_fast_calls = True


def _share_block_types() -> None:
    """block_type(element_ty, shape) with the attributes of the first such type (`tl.core.block_type.__init__` builds
    its shape as a `tl.tuple`, typing each element, and its name from that); arguments that are not plain (dims not
    all ints, an element type without a hash) and subclasses take Triton's own constructor."""
    from triton.language import core

    make = core.block_type.__init__
    made: dict = {}

    def init(self, element_ty, shape):
        key = None
        if type(self) is core.block_type:
            try:
                items = shape.values if isinstance(shape, core.tuple) else shape
                dims = tuple(d.value if isinstance(d, core.constexpr) else d for d in items)
                if all(type(d) is int for d in dims):
                    key = (element_ty, dims)
                    known = made.get(key)
                    if known is not None:
                        self.__dict__.update(known)
                        return
            except TypeError:
                key = None
        make(self, element_ty, shape)
        if key is not None:
            made[key] = dict(self.__dict__)

    core.block_type.__init__ = init
