"""The vLLM connector's pieces that need no vLLM (run in the normal suite): the extra-config checks, the
block layout's fingerprint and keys, the block mover's per-layer path, and the lazy import."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from pagedkv.integrations.vllm import EXTRA_CONFIG_KEYS, BlockLayout, BlockMover, parse_extra_config

LAYOUT = dict(model_id="m", layer_names=("l0", "l1"), spec_kind="FullAttentionSpec", dtype="torch.bfloat16",
              cache_dtype="auto", block_size=16, hash_block_size=16, num_heads=2, head_bytes=64, head_size=16,
              head_size_v=16, tp_size=2, hash_algo="sha256")  # fmt: skip


def test_defaults_and_every_key(tmp_path: Path) -> None:
    s = parse_extra_config({"disk_offload_dir": "rel/dir"})
    assert s.tiers.disk_offload_dir == str(Path("rel/dir").resolve()) and s.tiers.redis_url is None
    assert (s.load_async, s.model_id, s.tiers.redis_key_prefix, s.max_pending_save_bytes) == (False, "", "pagedkv:",
                                                                                            2048 * 2**20)  # fmt: skip
    key_file = tmp_path / "key"
    key_file.write_bytes(b"0123456789abcdef0123\n")
    full: dict[str, Any] = {
        "redis_cluster_nodes": ["10.0.0.1:7000", "10.0.0.2:7001"], "redis_key_prefix": "", "redis_username": "u",
        "redis_password": "p", "redis_ttl_s": 60, "redis_timeout_s": 0.5, "redis_retry_s": 2,
        "disk_offload_dir": str(tmp_path), "disk_offload_max_gb": 1.5, "disk_timeout_s": 2.5,
        "tier_hmac_key_file": str(key_file),
        "model_id": "llama@rev", "load_async": True, "io_threads": 8, "max_pending_save_mb": 64,
    }  # fmt: skip
    assert set(full) | {"redis_url", "tier_hmac_key"} == set(EXTRA_CONFIG_KEYS)
    s = parse_extra_config(full)
    t = s.tiers
    assert (t.redis_url, t.redis_cluster_nodes) == ("redis+cluster://10.0.0.1:7000", ("10.0.0.2:7001",))
    assert (t.redis_key_prefix, t.redis_ttl_s, t.redis_timeout_s, t.redis_retry_s, t.io_threads) == (
        "",
        60,
        0.5,
        2.0,
        8,
    )
    assert t.mac_key == b"0123456789abcdef0123"  # the file's final newline is not part of the key
    assert (t.disk_offload_max_gb, t.disk_timeout_s) == (1.5, 2.5)
    assert (s.model_id, s.load_async, s.max_pending_save_bytes, t.disk_offload_max_gb) == ("llama@rev", True,
                                                                                           64 * 2**20, 1.5)  # fmt: skip
    assert t.redis_password == "p" and "redis_password" not in repr(t) and "tier_hmac_key" not in repr(t)


@pytest.mark.parametrize(
    "extra,error,words",
    [
        (None, ValueError, "needs a tier"),
        ([1], TypeError, "must be a dict"),
        ({"disk_offload_dir": "/d", "Redis_URL": "x"}, ValueError, "unknown key(s) ['Redis_URL']"),
        ({"redis_url": "http://h:1"}, ValueError, "['redis_url']='http://h:1' must start with redis://"),
        ({"redis_url": "redis://h:1", "redis_cluster_nodes": ["h:1"]}, ValueError, "needs a redis+cluster://"),
        ({"redis_cluster_nodes": "h:1"}, TypeError, "['redis_cluster_nodes']='h:1' must be a non-empty list"),
        ({"redis_cluster_nodes": []}, TypeError, "must be a non-empty list"),
        ({"redis_cluster_nodes": ["h"]}, ValueError, "node 'h' must be 'host:port'"),
        ({"redis_cluster_nodes": ["h:99999"]}, ValueError, "port in 1..65535"),
        ({"redis_cluster_nodes": [7000]}, TypeError, "node 7000 must be a 'host:port' str"),
        ({"redis_cluster_nodes": ["h:1"] * 65}, ValueError, "65 nodes; at most 64"),
        ({"disk_offload_dir": ""}, ValueError, "['disk_offload_dir']='' must not be empty"),
        ({"disk_offload_dir": "a\x00b"}, ValueError, "NUL"),
        ({"disk_offload_dir": ["/d"]}, TypeError, "['disk_offload_dir']=['/d'] must be a str"),
        ({"disk_offload_dir": "/d", "disk_offload_max_gb": 0}, ValueError, "['disk_offload_max_gb']=0 must be > 0"),
        ({"disk_offload_dir": "/d", "disk_offload_max_gb": float("nan")}, ValueError, "disk_offload_max_gb"),
        ({"disk_offload_dir": "/d", "disk_offload_max_gb": "9"}, TypeError, "['disk_offload_max_gb']='9' must be a number"),
        ({"disk_offload_dir": "/d", "redis_timeout_s": -1}, ValueError, "['redis_timeout_s']=-1 must be > 0"),
        ({"disk_offload_dir": "/d", "redis_retry_s": 1e9}, ValueError, "and <= 86400"),
        ({"disk_offload_dir": "/d", "redis_ttl_s": 0}, ValueError, "['redis_ttl_s']=0 must be in [1, 2147483647]"),
        ({"disk_offload_dir": "/d", "redis_ttl_s": 1.5}, TypeError, "['redis_ttl_s']=1.5 must be an int"),
        ({"disk_offload_dir": "/d", "io_threads": True}, TypeError, "['io_threads']=True must be an int"),
        ({"disk_offload_dir": "/d", "io_threads": 1000}, ValueError, "['io_threads']=1000 must be in [1, 64]"),
        ({"disk_offload_dir": "/d", "max_pending_save_mb": 0}, ValueError, "['max_pending_save_mb']=0 must be in"),
        ({"disk_offload_dir": "/d", "load_async": 1}, TypeError, "['load_async']=1 must be true or false"),
        ({"disk_offload_dir": "/d", "tier_hmac_key": "short"}, ValueError, "['tier_hmac_key'] has 5 bytes"),
        ({"disk_offload_dir": "/d", "tier_hmac_key": 123456789012345678}, TypeError, "must be a str (got int)"),
        ({"disk_offload_dir": "/d", "tier_hmac_key": "k" * 16, "tier_hmac_key_file": "/f"}, ValueError, "both"),
        ({"disk_offload_dir": "/d", "tier_hmac_key_file": "/nonexistent/key"}, ValueError, "cannot be read"),
        ({"disk_offload_dir": "/d", "model_id": "a b"}, ValueError, "['model_id']='a b'... must be at most 256"),
        ({"disk_offload_dir": "/d", "redis_key_prefix": "x" * 300}, ValueError, "at most 256 characters"),
        ({"disk_offload_dir": "/d", "redis_key_prefix": "a*"}, ValueError, "['redis_key_prefix']='a*'... must be"),
    ],
)  # fmt: skip
def test_hostile_values_name_the_key_the_value_and_the_limit(extra: Any, error: type[Exception], words: str) -> None:
    with pytest.raises(error) as info:
        parse_extra_config(extra)
    assert words in str(info.value)


def test_a_secret_never_appears_in_an_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as info:
        parse_extra_config({"disk_offload_dir": "/d", "tier_hmac_key": "topsecret"})
    assert "topsecret" not in str(info.value)
    big = tmp_path / "big"
    big.write_bytes(b"s" * 5000)
    with pytest.raises(ValueError, match="more than 4096 bytes"):
        parse_extra_config({"disk_offload_dir": "/d", "tier_hmac_key_file": str(big)})


def test_fingerprint_covers_every_field_and_the_tp_rank() -> None:
    base = BlockLayout(**LAYOUT)  # type: ignore[arg-type]
    prints = {base.fingerprint(0), base.fingerprint(1)}
    changes = dict(model_id="other", layer_names=("l0",), spec_kind="MLAAttentionSpec", dtype="torch.float16",
                   cache_dtype="fp8", block_size=32, hash_block_size=8, num_heads=4, head_bytes=32, head_size=8,
                   head_size_v=0, tp_size=4, hash_algo="sha256_cbor")  # fmt: skip
    assert set(changes) == set(LAYOUT)
    for name, value in changes.items():
        prints.add(BlockLayout(**{**LAYOUT, name: value}).fingerprint(0))  # type: ignore[arg-type]
    assert len(prints) == 2 + len(changes)
    assert base.row_bytes == 2 * 2 * 16 * 64 and base.format_hash_algo == "sha256"
    with pytest.raises(ValueError, match=r"tp_rank=2 must be in \[0, 2\)"):
        base.fingerprint(2)
    with pytest.raises(ValueError, match="must divide block_size"):
        BlockLayout(**{**LAYOUT, "hash_block_size": 5})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="is not one of"):
        BlockLayout(**{**LAYOUT, "hash_algo": "md5"})  # type: ignore[arg-type]


def test_block_keys_are_the_hash_of_each_blocks_last_chunk() -> None:
    hashes = [bytes([i]) * 32 for i in range(7)]
    assert BlockLayout(**LAYOUT).block_keys(hashes) == hashes  # type: ignore[arg-type]
    quarter = BlockLayout(**{**LAYOUT, "hash_block_size": 4})  # type: ignore[arg-type]
    assert quarter.block_keys(hashes) == [hashes[3]]  # 7 chunks of 4 tokens: one full block of 16
    with pytest.raises(TypeError, match="1 to 32 bytes"):
        BlockLayout(**LAYOUT).block_keys([123])  # type: ignore[arg-type, list-item]


def test_layers_in_separate_tensors_are_copied_one_by_one() -> None:
    gen = torch.Generator().manual_seed(1)
    caches = {f"l{i}": torch.randn((6, 2, 4, 8), generator=gen).to(torch.bfloat16) for i in range(3)}  # [B, H, N, C]
    caches["l1"] = caches["l1"].transpose(1, 2).contiguous().transpose(1, 2)  # another stride order
    mover = BlockMover(caches, ["l2", "l0", "l1"])
    assert mover.stacked is None and mover.block_shape == (3, 2, 4, 16)
    rows = torch.empty((2, mover.row_bytes), dtype=torch.uint8)
    mover.gather([4, 0], rows)
    for i, block in enumerate([4, 0]):
        want = torch.cat([caches[n][block].contiguous().view(torch.uint8).flatten() for n in ["l2", "l0", "l1"]])
        assert torch.equal(rows[i], want)
    mover.scatter(rows, [1, 5])
    for name in caches:
        assert torch.equal(caches[name][[1, 5]], caches[name][[4, 0]])
    with pytest.raises(ValueError, match=r"block ids must be in \[0, 6\)"):
        mover.gather([6], rows[:1])
    with pytest.raises(ValueError, match="no tensor for layer"):
        BlockMover(caches, ["l0", "l9"])


def test_importing_the_package_imports_neither_vllm_nor_torch_nor_redis() -> None:
    code = (
        "import sys, pagedkv, pagedkv.integrations.vllm as m\n"
        "assert not {'vllm', 'torch', 'redis'} & set(sys.modules), sorted({'vllm', 'torch', 'redis'} & set(sys.modules))\n"
        "assert 'PagedKVConnector' in dir(m)\n"
        "try:\n"
        "    import vllm\n"
        "except ImportError:\n"
        "    try:\n"
        "        m.PagedKVConnector\n"
        "    except ImportError as exc:\n"
        "        print('needs vllm:', exc.name)\n"
        "else:\n"
        "    print('needs vllm: vllm')\n"
    )  # fmt: skip
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "needs vllm: vllm"


def test_the_tiers_keep_each_signing_key_in_a_namespace_of_its_own(tmp_path: Path) -> None:
    """The connector's tiers name pages as every pagedkv tier does: the layout fingerprint, then the key id of a
    signing key, so engines with another key (or none) never look up, refuse or write the deployment's pages."""
    from pagedkv.integrations.vllm.tiers import TierSet
    from pagedkv.offload.format import key_id
    from pagedkv.params.connector import KVConnectorConfig

    fingerprint = BlockLayout(**LAYOUT).fingerprint(0)  # type: ignore[arg-type]
    names = []
    for key in (None, "the deployment's key", "another deployment's key"):
        tiers = TierSet(KVConnectorConfig(disk_offload_dir=str(tmp_path), tier_hmac_key=key), 64, fingerprint, "sha256")
        [disk] = tiers.tiers
        names.append(disk.root.name)  # type: ignore[attr-defined]
        tiers.shutdown()
    assert names == [fingerprint.hex()] + [f"{fingerprint.hex()}-{key_id(k)}" for k in
                                           (b"the deployment's key", b"another deployment's key")]  # fmt: skip
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names)
