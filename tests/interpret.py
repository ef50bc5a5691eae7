"""Triton's interpreter (TRITON_INTERPRET=1), as the CPU kernel tests run it, without its
repeated set-up work.

Each launch points triton.language's builtins at the interpreter (``_patch_lang``) for the
launch's duration. Each call of a device function inside the kernel (a ``@triton.jit`` helper,
a ``tl.reduce`` combine function) does it again, walking the language modules with
``inspect.getmembers``: for kernels built from small helpers that repeat is most of the
interpreter's time. ``patch_language_once()`` lets such a call reuse the running launch's patch
whenever the launch has already patched every language module the function sees (a helper of
triton.language itself sees ``triton.language.core``, which a kernel usually does not). What
the kernels compute is unchanged.
"""

from __future__ import annotations


def patch_language_once() -> None:
    """Install the reuse in this process (after Triton is imported with TRITON_INTERPRET=1).
    A Triton whose interpreter is laid out otherwise is left as it is."""
    import inspect

    import triton.language as tl
    from triton.runtime import interpreter

    patch, launch = getattr(interpreter, "_patch_lang", None), getattr(interpreter, "GridExecutor", None)
    if patch is None or launch is None or getattr(patch, "reuses_the_launch", False):
        return
    run = launch.__call__
    patched: list[frozenset[int]] | None = None  # in a launch: the language modules it patched

    def languages(fn) -> frozenset[int]:
        return frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))

    def patch_once(fn):
        seen = languages(fn)
        if patched is not None and any(seen <= done for done in patched):
            return interpreter._LangPatchScope()  # nothing new to patch, nothing to undo
        scope = patch(fn)
        if patched is not None:
            patched.append(seen)
        return scope

    def run_once(self, *args, **kwargs):
        nonlocal patched
        patched = []
        try:
            return run(self, *args, **kwargs)
        finally:
            patched = None

    patch_once.reuses_the_launch = True
    interpreter._patch_lang = patch_once
    launch.__call__ = run_once
