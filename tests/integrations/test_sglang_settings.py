"""`pagedkv.integrations.sglang` without SGLang: the package imports nothing heavy, its extra_config is checked.

The backend itself runs against the real SGLang in tests/peers/test_sglang_storage.py (`.venv-peers`).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pagedkv.integrations.sglang import StorageSettings
from pagedkv.integrations.sglang.keys import namespace, page_key
from pagedkv.integrations.vllm import parse_extra_config


def test_importing_the_package_imports_neither_sglang_torch_nor_redis() -> None:
    code = ("import sys, pagedkv.integrations.sglang as m\n"
            "print(sorted(n for n in ('sglang', 'torch', 'redis') if n in sys.modules), 'PagedKVStorage' in dir(m))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[] True"


def test_settings_of_each_medium(tmp_path: Path) -> None:
    redis = StorageSettings.from_extra_config({"backend_name": "pagedkv", "module_path": "m", "class_name": "C",
                                               "interface_v1": 1, "redis_url": "redis://h:6379/0", "io_threads": 2})  # fmt: skip
    assert (redis.medium, redis.io_threads, redis.redis_key_prefix, redis.tier_hmac_key) == ("redis", 2,
                                                                                           "pagedkv:sglang:", None)  # fmt: skip
    config = redis.connector_config("m", "tiny_0_1")
    assert (config.redis_key_prefix, config.io_threads, config.disk_offload_dir) == (
        "pagedkv:sglang:tiny_0_1:",
        2,
        None,
    )
    nodes = StorageSettings.from_extra_config({"redis_cluster_nodes": ["a:7000", "b:7001", "[::1]:7002"]})
    assert (nodes.redis_url, nodes.redis_cluster_nodes) == ("redis+cluster://a:7000", ("b:7001", "[::1]:7002"))
    (tmp_path / "key").write_text("0123456789abcdef\n")
    disk = StorageSettings.from_extra_config({"disk_offload_dir": str(tmp_path), "disk_offload_max_gb": 0.5,
                                              "disk_timeout_s": 2.5, "tier_hmac_key_file": str(tmp_path / "key"),
                                              "model_id": "llama@main"})  # fmt: skip
    assert (disk.medium, disk.disk_offload_max_gb, disk.tier_hmac_key) == ("disk", 0.5, b"0123456789abcdef")
    assert disk.connector_config("m", "tiny_0_1").model_id == "llama@main"
    assert disk.connector_config("m", "tiny_0_1").disk_timeout_s == 2.5
    assert redis.connector_config("m", "tiny_0_1").model_id == "m"
    assert disk.connector_config("m", "tiny_0_1").disk_offload_dir == str(tmp_path / "tiny_0_1")


@pytest.mark.parametrize(
    "extra,error,message",
    [
        ([1], TypeError, r"extra_config=\[1\] must be a JSON object"),
        ({"disk_offload_dir": "/x", "capacity_gb": 1}, ValueError, r"unknown key\(s\) \['capacity_gb'\]"),
        ({"disk_offload_dir": "/x", "io_threads": 65}, ValueError, r"\['io_threads'\]=65 must be in \[1, 64\]"),
        (
            {"disk_offload_dir": "/x", "disk_offload_max_gb": float("nan")},
            ValueError,
            r"\['disk_offload_max_gb'\]=nan must be > 0",
        ),
        ({"disk_offload_dir": "/x", "disk_timeout_s": 0}, ValueError, r"\['disk_timeout_s'\]=0 must be > 0"),
        ({"redis_url": "redis://h:1", "disk_timeout_s": 1}, ValueError, r"applies to a directory \(disk_offload_dir\)"),
        ({"disk_offload_dir": "/x\0"}, ValueError, r"\['disk_offload_dir'\]='/x\\x00' must be a path without NUL"),
        ({"disk_offload_dir": "/x", "model_id": "a b"}, ValueError, r"\['model_id'\]='a b'... must be at most 256"),
        ({"redis_cluster_nodes": []}, TypeError, r"\['redis_cluster_nodes'\]=\[\] must be a non-empty list"),
        ({"redis_cluster_nodes": [7000]}, TypeError, r"redis cluster node 7000 must be a 'host:port' str"),
        ({"redis_url": "redis://h:1", "redis_key_prefix": 5}, TypeError, r"\['redis_key_prefix'\]=5 must be a str"),
    ],
)
def test_bad_values_name_the_key_the_value_and_the_limit(extra: object, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        StorageSettings.from_extra_config(extra)  # type: ignore[arg-type]


def test_the_tier_keys_are_the_vllm_connectors() -> None:
    from pagedkv.integrations.tier_keys import TIER_KEYS
    from pagedkv.integrations.vllm import EXTRA_CONFIG_KEYS

    assert (
        TIER_KEYS <= set(EXTRA_CONFIG_KEYS) and TIER_KEYS == StorageSettings.from_extra_config.__globals__["KNOWN_KEYS"]
    )
    for extra in ({"disk_offload_dir": "/x", "io_threads": 0}, {"redis_url": "redis://h:1", "redis_retry_s": 0}):
        with pytest.raises(ValueError) as sglang:
            StorageSettings.from_extra_config(extra)
        with pytest.raises(ValueError) as vllm:
            parse_extra_config(extra)
        assert str(sglang.value).removeprefix("extra_config") == str(vllm.value).removeprefix(
            "kv_connector_extra_config"
        )


def test_keys_and_namespaces() -> None:
    hex_key = "ab" * 32
    assert page_key(hex_key) == bytes.fromhex(hex_key) and len(page_key("not hex")) == 32
    assert page_key("not hex") != page_key("not hex.mamba")

    class Config:
        model_name, tp_rank, tp_size, pp_rank, pp_size = "meta-llama/Llama 3:8B", 1, 4, 0, 1

    assert namespace(Config) == "meta-llama-Llama-3-8B_1_4"
    assert namespace(Config, "llama@main") == "llama-main_1_4"
    Config.pp_size, Config.pp_rank, Config.model_name = 2, 1, "../x"
    assert namespace(Config) == "-x_1_4_2_1"
