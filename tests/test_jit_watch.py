"""The late-compile watch (engine/jit_watch.py) on Triton's real JIT hooks: it chains to the
hooks already set, never skips a compile by itself, logs each compile with its kernel and
seconds, and puts the previous hooks back. (A real compile needs a GPU; here the hooks are
called as triton.runtime.jit calls them.)"""
from __future__ import annotations

import logging

import pytest

from engine.jit_watch import LateCompileWatch

knobs = pytest.importorskip("triton.knobs")


def test_the_watch_chains_logs_and_restores(caplog: pytest.LogCaptureFixture) -> None:
    runtime = knobs.runtime
    before = (runtime.jit_cache_hook, runtime.jit_post_compile_hook)
    seen: list[str] = []

    def cache_hook(**kwargs):
        seen.append("cache " + kwargs["repr"])
        return False

    def post_hook(**kwargs):
        seen.append("post " + kwargs["repr"])

    runtime.jit_cache_hook, runtime.jit_post_compile_hook = cache_hook, post_hook
    told: list[tuple[str, float]] = []
    watch = LateCompileWatch(on_compile=lambda name, s: told.append((name, s)))
    try:
        assert watch.install()
        assert runtime.jit_cache_hook == watch.before_compile and runtime.jit_post_compile_hook == watch.after_compile
        spec = "extend_attention_kernel[num_warps=4](q: *bf16, n: i32)"
        with caplog.at_level(logging.WARNING, logger="engine.jit_watch"):
            assert runtime.jit_cache_hook(key=("k", 1), repr=spec, fn=None, compile={}, is_manual_warmup=False,
                                          already_compiled=False) is False  # the previous hook's answer
            runtime.jit_post_compile_hook(key=("k", 1), repr=spec, fn=None, compile={}, is_manual_warmup=False,
                                          already_compiled=False)
        assert seen == ["cache " + spec, "post " + spec]
        assert [name for name, _ in watch.compiles] == [spec] and told == watch.compiles
        assert watch.compiles[0][1] >= 0
        assert "extend_attention_kernel" in caplog.text and "after warm-up" in caplog.text
    finally:
        watch.uninstall()
        restored = (runtime.jit_cache_hook, runtime.jit_post_compile_hook)
        runtime.jit_cache_hook, runtime.jit_post_compile_hook = before
    assert restored == (cache_hook, post_hook)


def test_alone_it_never_asks_triton_to_skip_a_compile() -> None:
    runtime = knobs.runtime
    before = (runtime.jit_cache_hook, runtime.jit_post_compile_hook)
    runtime.jit_cache_hook = runtime.jit_post_compile_hook = None
    watch = LateCompileWatch()
    try:
        assert watch.install()
        assert not runtime.jit_cache_hook(key=[1, 2], repr="k")  # an unhashable key is fine too
        runtime.jit_post_compile_hook(key=[1, 2], repr="k")
        assert watch.compiles and watch.compiles[0][0] == "k"
    finally:
        watch.uninstall()
        assert (runtime.jit_cache_hook, runtime.jit_post_compile_hook) == (None, None)
        runtime.jit_cache_hook, runtime.jit_post_compile_hook = before
