"""A faster Triton interpreter for the tests that run kernels on the CPU (TRITON_INTERPRET=1).

Triton's interpreter (3.x) patches the language modules (`triton.language`, `triton.language.core`)
found in a function's globals on every call of a device function (a @triton.jit function called from
a kernel): `inspect.getmembers` over them, about half a millisecond each time. Within one launch the
patches of a module hold until the launch ends, so patching a module again changes nothing: it only
finds the builtins already replaced. A kernel that calls small helpers inside its loops (the sampling
kernel's bisections call `_load` and `fixed_weight` some 1,400 times a row) spends half its
interpreted time there.

`skip_repatching()` lets a device call patch only the modules the launch has not patched yet (a
helper of `triton.language.standard` reaches `core`, which a kernel module's `tl` does not): the
kernel runs the same interpreted code. With an interpreter without `_patch_lang` it does nothing.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator


@contextlib.contextmanager
def skip_repatching() -> Iterator[None]:
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        yield
        return
    original = getattr(interpreter, "_patch_lang", None)
    scope_class = getattr(interpreter, "_LangPatchScope", None)
    if original is None or scope_class is None:
        yield
        return
    launch: list[set[int]] = []  # the language modules the running launch has patched (by id)
    langs_of: dict[object, set[int]] = {}

    def langs(fn) -> set[int]:
        if fn not in langs_of:  # the modules the interpreter patches for fn
            found = {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}
            langs_of[fn] = found
        return langs_of[fn]

    def patch_lang(fn):
        if launch and langs(fn) <= launch[-1]:
            return scope_class()  # patched already, until the launch restores them
        scope = original(fn)
        if launch:  # a device call that reached another module: patched as the interpreter does
            launch[-1] |= langs(fn)
            return scope
        launch.append(set(langs(fn)))
        restore = scope.restore

        def restore_and_end() -> None:
            launch.pop()
            restore()

        scope.restore = restore_and_end
        return scope

    interpreter._patch_lang = patch_lang
    try:
        yield
    finally:
        interpreter._patch_lang = original
