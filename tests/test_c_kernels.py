"""Bios's C kernels (bios.kernels.c_kernels): built once per machine with its C compiler into the Bios cache and
found there afterwards; without a compiler, or with `BIOS_C_KERNELS=off`, there are none (and a warning says
why), so their callers keep PyTorch's ops."""

from __future__ import annotations

import subprocess

import pytest

from bios.kernels import c_kernels


@pytest.fixture(autouse=True)
def _fresh(monkeypatch, tmp_path):
    monkeypatch.delenv("BIOS_C_KERNELS", raising=False)
    monkeypatch.setenv("BIOS_CACHE_DIR", str(tmp_path))
    c_kernels._loaded.cache_clear()
    yield
    c_kernels._loaded.cache_clear()


@pytest.mark.skipif(c_kernels.c_compiler() is None, reason="no C compiler here")
def test_the_kernels_are_built_once_into_the_bios_cache(tmp_path, monkeypatch):
    kernels = c_kernels.c_kernels()
    assert kernels is not None and kernels.width in (8, 16)
    built = list((tmp_path / "kernels").glob("bios-kernels-*.so"))
    assert len(built) == 1 and not list((tmp_path / "kernels").glob("tmp*"))  # no staging left behind
    c_kernels._loaded.cache_clear()

    def no_compiler(*args, **kwargs):
        raise AssertionError("compiled again")

    monkeypatch.setattr(subprocess, "run", no_compiler)
    assert c_kernels.c_kernels() is not None and list((tmp_path / "kernels").glob("bios-kernels-*.so")) == built
    monkeypatch.setenv("BIOS_C_KERNELS", "off")
    assert c_kernels.c_kernels() is None
    monkeypatch.setenv("BIOS_C_KERNELS", "fast")
    with pytest.raises(ValueError, match="BIOS_C_KERNELS must be 'auto' or 'off'"):
        c_kernels.c_kernels()


def test_without_a_compiler_there_are_none_and_a_warning_says_why(monkeypatch, caplog):
    monkeypatch.setenv("CC", "no-such-compiler-here")
    with caplog.at_level("WARNING", logger="bios.kernels.c_kernels"):
        assert c_kernels.c_kernels() is None
    assert "could not build bios/kernels/csrc" in caplog.text and "set CC" in caplog.text


def test_a_failed_build_says_what_the_compiler_said(monkeypatch, caplog, tmp_path):
    failing = tmp_path / "cc"
    failing.write_text("#!/bin/sh\necho 'error: this compiler refuses' >&2\nexit 1\n")
    failing.chmod(0o755)
    monkeypatch.setenv("CC", str(failing))
    with caplog.at_level("WARNING", logger="bios.kernels.c_kernels"):
        assert c_kernels.c_kernels() is None
    assert "exited 1" in caplog.text and "this compiler refuses" in caplog.text


def test_bios_c_isa_builds_the_avx2_kernels_and_the_worker_chooses_as_an_avx2_cpu(monkeypatch):
    """`BIOS_C_ISA=avx2` on any x86 CPU with AVX2: 8-float kernels, a library of its own in the cache, and no
    native bf16 (so the worker keeps fp32, as on an AVX2-only machine); a value that is not an ISA says so."""
    import torch

    from bios.worker.compute_mode import base_dtype, native_bf16

    monkeypatch.delenv("BIOS_BASE_DTYPE", raising=False)
    monkeypatch.setenv("BIOS_C_ISA", "avx2")
    assert c_kernels.c_isa() == "AVX2"
    assert native_bf16(torch.device("cpu")) is None
    assert base_dtype(torch.device("cpu")).dtype is None  # the loaded dtype: fp32 for every model a test builds
    if c_kernels.c_compiler() is not None and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        assert c_kernels.c_kernels().width == 8
    monkeypatch.setenv("BIOS_C_ISA", "auto")
    assert c_kernels.c_isa() == (torch.backends.cpu.get_cpu_capability()
                                 if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") else None)
    monkeypatch.setenv("BIOS_C_ISA", "sse4")
    with pytest.raises(ValueError, match="BIOS_C_ISA must be 'avx2' or 'avx512'"):
        c_kernels.c_isa()
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        monkeypatch.setenv("BIOS_C_ISA", "avx512")
        with pytest.raises(ValueError, match="has no AVX-512"):
            c_kernels.c_isa()
