"""The whole-process peers bench's configurations: what each process is told (engine, compute type, ISA mask)."""

from rayspec.bench.process import ISA_SWITCHES, command, parse_config


def test_a_mask_holds_every_kernel_library_of_both_engines_to_one_isa(monkeypatch):
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE")  # inherited masks never leak into another configuration
    assert parse_config("rayspec#AVX2") == ("rayspec", "auto", "AVX2", False)
    assert parse_config("faster-whisper@int8#AVX2:batched") == ("faster-whisper", "int8", "AVX2", True)
    for config in ("rayspec#AVX2", "faster-whisper@int8#AVX2"):
        cmd, env = command(config, "m.jsonl", "out", 2, "ct2")
        assert {k: env[k] for k in ISA_SWITCHES} == {
            "ONEDNN_MAX_CPU_ISA": "AVX2", "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2", "ATEN_CPU_CAPABILITY": "avx2",
            "MKL_ENABLE_INSTRUCTIONS": "AVX2", "CT2_FORCE_CPU_ISA": "AVX2"}
    cmd, env = command("rayspec@int8", "m.jsonl", "out", 2, "ct2")
    assert not set(ISA_SWITCHES) & set(env) and cmd[cmd.index("--compute-type") + 1] == "int8"


def test_rayspec_is_byte_compiled_before_the_timed_processes(monkeypatch, tmp_path):
    import compileall
    import os

    import rayspec
    from rayspec.bench import process

    compiled = []
    monkeypatch.setattr(compileall, "compile_dir", lambda d, **kw: compiled.append(d))
    monkeypatch.setattr(process, "run_once", lambda *a: (_ for _ in ()).throw(RuntimeError("stop")))
    best, failures = process.run_processes(["rayspec"], "m.jsonl", str(tmp_path), 2, "ct2", repeats=1,
                                           progress=False)
    assert compiled == [os.path.dirname(rayspec.__file__)] and not best and failures == ["stop"]
