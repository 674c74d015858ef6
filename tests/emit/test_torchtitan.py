"""emit/torchtitan: the job config TOML read back by torchtitan's own parser (its
``ConfigManager``, where torchtitan 0.2 is installed) and, everywhere, checked key by key and
type by type against the dataclasses of torchtitan 0.2.2's ``torchtitan/config/job_config.py``
(``torchtitan_job_config_0.2.2.json``, written from them: ``python -m
tests.emit.test_torchtitan`` writes it again where torchtitan is installed)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
import sys
import types
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import pytest

from autoshard import emit
from autoshard.config import Candidate, Checkpointing, Engine, Precision, Sharding, WorkloadSpec
from autoshard.errors import ConfigError
from tests.test_emit import candidate, make_rec

tomllib = pytest.importorskip("tomllib")  # Python 3.11

SCHEMA = Path(__file__).with_name("torchtitan_job_config_0.2.2.json")


# ---------------------------------------------------------------------------------------------
# torchtitan's keys and types
# ---------------------------------------------------------------------------------------------


def _type_of(annotation: Any) -> Any:
    """A field's annotation as JSON: {"choices": [...]}, {"list_of": ...}, {"any_of": [...]}
    or {"type": name}."""
    origin = get_origin(annotation)
    if origin is Literal:
        return {"choices": list(get_args(annotation))}
    if origin is list:
        return {"list_of": _type_of(get_args(annotation)[0])}
    if origin in (Union, types.UnionType):
        return {"any_of": [_type_of(a) for a in get_args(annotation)]}
    return {"type": annotation.__name__}


def schema_of(cls: Any, prefix: str = "") -> dict[str, Any]:
    """Every leaf key of a torchtitan config dataclass, dotted (``parallelism.x``), with its
    type."""
    out: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        if dataclasses.is_dataclass(field.type):
            out.update(schema_of(field.type, f"{prefix}{field.name}."))
        else:
            out[f"{prefix}{field.name}"] = _type_of(field.type)
    return out


def conforms(value: Any, kind: dict[str, Any]) -> bool:
    """Whether a TOML value is of the type torchtitan declares."""
    if "choices" in kind:
        return value in kind["choices"]
    if "list_of" in kind:
        return isinstance(value, list) and all(conforms(v, kind["list_of"]) for v in value)
    if "any_of" in kind:
        return any(conforms(value, k) for k in kind["any_of"])
    expected = {"bool": bool, "int": int, "float": (int, float), "str": str}[kind["type"]]
    # a TOML boolean is no int, and an int no boolean (True == 1 in Python)
    return isinstance(value, expected) and (isinstance(value, bool) == (kind["type"] == "bool"))


def torchtitan_config_module() -> Any:
    """torchtitan's ``torchtitan.config``, or None where it is not installed. Its package's
    ``__init__`` imports its MoE kernels, which need triton (absent from CPU torch): the package
    is entered without it."""
    if "torchtitan" not in sys.modules:
        spec = importlib.util.find_spec("torchtitan")
        if spec is None or spec.submodule_search_locations is None:
            return None
        package = types.ModuleType("torchtitan")
        package.__path__ = list(spec.submodule_search_locations)
        sys.modules["torchtitan"] = package
    try:
        import torchtitan.config as config  # type: ignore[import-not-found]
    except ImportError:
        return None
    return config


def leaves(sections: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """The TOML's tables flattened to dotted keys."""
    out: dict[str, Any] = {}
    for key, value in sections.items():
        if isinstance(value, dict):
            out.update(leaves(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


# ---------------------------------------------------------------------------------------------
# The decisions
# ---------------------------------------------------------------------------------------------


def fsdp2_grid() -> list[Candidate]:
    """FSDP2 decisions the TOML can express: every sharding, checkpointing, reshard policy and
    bf16/fp32 precision, with and without offload, compile and float8."""
    out = []
    for sharding, mesh in (("FULL_SHARD", None), ("SHARD_GRAD_OP", None), ("NO_SHARD", None),
                           ("HYBRID_SHARD", (1, 2))):  # fmt: skip
        for ckpt, every in (("none", 1), ("every_k", 2), ("every_k", 3), ("selective", 1),
                            ("all", 1)):  # fmt: skip
            for precision in ("bf16-mixed", "32-true", "bf16-true"):
                base = {"engine": "fsdp2", "sharding": sharding, "hybrid_mesh": mesh,
                        "checkpointing": ckpt, "checkpoint_every": every, "precision": precision}  # fmt: skip
                out.append(candidate(**base))
                out.append(candidate(**base, reshard="keep_root_and_last", compile=True))
                if precision != "32-true":
                    out.append(candidate(**base, float8=True, reshard="keep_root"))
                out.append(candidate(**base, cpu_offload=True, optimizer_impl="fused"))
    return out


def toml_of(c: Candidate, **rec: Any) -> dict[str, Any]:
    return tomllib.loads(emit.render(make_rec(c, **rec), "torchtitan"))


# ---------------------------------------------------------------------------------------------


def test_every_key_is_torchtitans_and_of_its_type() -> None:
    schema = json.loads(SCHEMA.read_text())
    seen: set[str] = set()
    for c in fsdp2_grid():
        for key, value in leaves(toml_of(c)).items():
            assert key in schema, f"{key}: not a key of torchtitan's job config ({c.label()})"
            assert conforms(value, schema[key]), f"{key} = {value!r}: not {schema[key]}"
            seen.add(key)
    # what the grid covers: every section autoshard writes
    assert {k.rpartition(".")[0] for k in seen} == {
        "training", "parallelism", "activation_checkpoint", "compile", "optimizer", "model",
        "quantize.linear.float8",
    }  # fmt: skip


def test_the_key_snapshot_is_torchtitans_own() -> None:
    config = torchtitan_config_module()
    if config is None:
        pytest.skip("torchtitan is not installed (pip install --no-deps torchtitan==0.2.2 tyro)")
    assert schema_of(config.JobConfig) == json.loads(SCHEMA.read_text())


def test_torchtitans_parser_reads_every_value_as_written(tmp_path: Path) -> None:
    config = torchtitan_config_module()
    if config is None:
        pytest.skip("torchtitan is not installed (pip install --no-deps torchtitan==0.2.2 tyro)")
    for i, c in enumerate(fsdp2_grid()[::8]):
        path = tmp_path / f"{i}.toml"
        path.write_text(emit.render(make_rec(c), "torchtitan"))
        parsed = config.ConfigManager().parse_args(["--job.config_file", str(path)])
        for key, value in leaves(tomllib.loads(path.read_text())).items():
            got: Any = parsed
            for part in key.split("."):
                got = getattr(got, part)
            assert got == value, (key, c.label())


def test_the_mesh_the_reshard_policy_and_the_checkpointing() -> None:
    # HARDWARE of the fixtures: 1 node of 2 ranks
    def parallelism(**update: Any) -> dict[str, Any]:
        return toml_of(candidate(engine=Engine.FSDP2, **update))["parallelism"]

    assert parallelism() == {
        "data_parallel_shard_degree": 2, "data_parallel_replicate_degree": 1,
        "fsdp_reshard_after_forward": "always",
    }  # fmt: skip
    hybrid = parallelism(sharding=Sharding.HYBRID_SHARD, hybrid_mesh=(2, 1))
    assert (hybrid["data_parallel_shard_degree"], hybrid["data_parallel_replicate_degree"]) == (
        1,
        2,
    )
    assert parallelism(sharding=Sharding.SHARD_GRAD_OP)["fsdp_reshard_after_forward"] == "never"
    for kept in ("keep_root", "keep_root_and_last"):
        assert parallelism(reshard=kept)["fsdp_reshard_after_forward"] == "default"

    def checkpointing(kind: str, every: int = 1) -> dict[str, Any]:
        c = candidate(engine=Engine.FSDP2, checkpointing=kind, checkpoint_every=every)
        return toml_of(c)["activation_checkpoint"]

    assert checkpointing("none") == {"mode": "none"}
    assert checkpointing("all") == {"mode": "full"}
    assert checkpointing("selective") == {"mode": "selective", "selective_ac_option": "op"}
    assert checkpointing("every_k", 2) == {"mode": "selective", "selective_ac_option": "2"}


def test_precision_batch_compile_float8_and_optimizer() -> None:
    def training(precision: Precision, **update: Any) -> dict[str, Any]:
        return toml_of(candidate(engine=Engine.FSDP2, precision=precision, **update))["training"]

    assert training(Precision.BF16_MIXED) == {
        "local_batch_size": 2, "seq_len": 128, "dtype": "float32",
        "mixed_precision_param": "bfloat16", "mixed_precision_reduce": "float32",
        "enable_cpu_offload": False,
    }  # fmt: skip
    assert training(Precision.FP32)["mixed_precision_param"] == "float32"
    assert training(Precision.BF16_TRUE)["dtype"] == "bfloat16"
    assert training(Precision.BF16_MIXED, cpu_offload=True)["enable_cpu_offload"] is True
    eager = toml_of(candidate(engine=Engine.FSDP2))
    assert eager["compile"] == {"enable": False}
    assert "model" not in eager and "quantize" not in eager
    assert eager["optimizer"] == {"name": "AdamW", "implementation": "foreach"}
    both = toml_of(
        candidate(engine=Engine.FSDP2, compile=True, float8=True, optimizer_impl="fused")
    )
    assert both["compile"] == {"enable": True, "components": ["model"]}
    assert both["model"] == {"converters": ["quantize.linear.float8"]}
    assert both["quantize"]["linear"]["float8"]["enable_fsdp_float8_all_gather"] is True
    assert both["optimizer"]["implementation"] == "fused"


def test_accumulation_sets_the_global_batch_and_says_how_torchtitan_reduces() -> None:
    rec = make_rec(candidate(engine=Engine.FSDP2))
    accumulating = rec.model_copy(update={"workload": WorkloadSpec(micro_batch_size=2, seq_len=128,
                                                                   accumulate=4)})  # fmt: skip
    text = emit.render(accumulating, "torchtitan")
    # torchtitan accumulates global / (local x 2 ranks) = 4 micro-batches
    assert tomllib.loads(text)["training"]["global_batch_size"] == 2 * 2 * 4
    assert "# 4 micro-batches accumulate per step; torchtitan reduces gradients after each" in text
    assert "global_batch_size" not in toml_of(candidate(engine=Engine.FSDP2))["training"]


def test_what_torchtitan_cannot_express_is_said_or_refused() -> None:
    odd = make_rec(candidate(engine=Engine.FSDP2, checkpointing=Checkpointing.EVERY_K,
                             checkpoint_every=3))  # fmt: skip
    # 4 blocks: torchtitan checkpoints block 3 only, autoshard blocks 1 and 4
    assert "torchtitan checkpoints blocks 3, 6, ... (counting from 1): 1 of 4; autoshard " \
        "checkpointed 2 (blocks 1, 4, ...)" in emit.render(odd, "torchtitan")  # fmt: skip
    kept = emit.render(make_rec(candidate(engine=Engine.FSDP2, reshard="keep_root")), "torchtitan")
    assert "torchtitan's nearest policy, default, keeps its final norm + output unit" in kept
    low = emit.render(make_rec(candidate(engine=Engine.FSDP2, reduce_dtype_fp32=False)),
                      "torchtitan")  # fmt: skip
    assert "torchtitan reduces gradients in fp32; autoshard's trials reduced them in bf16" in low
    for c, words in (
        (candidate(), "torchtitan runs FSDP2 (fully_shard) only"),
        (candidate(engine=Engine.FSDP2, precision=Precision.FP16_MIXED), "not 16-mixed"),
        (candidate(engine=Engine.FSDP2, optimizer="sgd"), "builds adamw or adam only, not sgd"),
    ):
        with pytest.raises(ConfigError, match=re.escape(words)):
            emit.render(make_rec(c), "torchtitan")


if __name__ == "__main__":
    module = torchtitan_config_module()
    if module is None:
        sys.exit("torchtitan is not installed: pip install --no-deps torchtitan==0.2.2 tyro")
    SCHEMA.write_text(json.dumps(schema_of(module.JobConfig), indent=1, sort_keys=True) + "\n")
    print(f"wrote {SCHEMA}")
