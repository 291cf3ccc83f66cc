"""The default hash seed: per deployment, secret, shared by every process that resolves the same file or
environment, and folded with the weights version into every chain's root."""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import make_params
from pagedkv.core.hashing import hash_tokens, root_digest
from pagedkv.params import deployment_seed as ds

TOKENS = list(range(1, 34))


@pytest.fixture
def seed_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "cfg" / "pagedkv" / "hash_seed"
    monkeypatch.delenv(ds.SEED_ENV, raising=False)
    monkeypatch.setenv(ds.SEED_FILE_ENV, str(path))
    return path


def _child_seed(env: dict[str, str]) -> str:
    code = "from pagedkv.params.deployment_seed import deployment_seed; print(deployment_seed().hex())"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_default_seed_is_created_once_private_and_shared_by_processes(seed_env: Path) -> None:
    params = make_params(enable_prefix_caching=True)
    seed = seed_env.read_bytes()
    assert params.kv_hash_seed == seed and len(seed) == 32 and seed != bytes(32)
    assert stat.S_IMODE(seed_env.stat().st_mode) == 0o600
    assert _child_seed({ds.SEED_FILE_ENV: str(seed_env)}) == seed.hex()  # another process: the same seed
    assert make_params().kv_hash_seed == seed
    assert [p.name for p in seed_env.parent.iterdir()] == ["hash_seed"]  # no temporary file left


def test_racing_processes_agree_on_one_seed(tmp_path: Path) -> None:
    path = tmp_path / "race" / "hash_seed"
    code = "from pagedkv.params.deployment_seed import deployment_seed; print(deployment_seed().hex())"
    env = {**os.environ, ds.SEED_FILE_ENV: str(path)}
    env.pop(ds.SEED_ENV, None)
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(6)]  # fmt: skip
    seeds = {p.communicate()[0].strip() for p in procs}
    assert seeds == {path.read_bytes().hex()}


def test_environment_beats_file_and_explicit_beats_both(seed_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ds.SEED_ENV, "ab" * 32)
    assert make_params().kv_hash_seed == bytes([0xAB]) * 32
    assert not seed_env.exists()
    assert make_params(kv_hash_seed=bytes(32)).kv_hash_seed == bytes(32)  # MAX's all-zero seed, on request
    monkeypatch.setenv(ds.SEED_ENV, "abc")
    with pytest.raises(ValueError, match="PAGEDKV_HASH_SEED='abc' is not hex"):
        make_params()
    monkeypatch.setenv(ds.SEED_ENV, "ab" * 8)
    with pytest.raises(ValueError, match="holds 8 bytes; it must hold exactly 32"):
        make_params()


def test_unwritable_location_falls_back_to_a_process_seed_with_a_warning(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    env = {ds.SEED_FILE_ENV: str(blocker / "pagedkv" / "hash_seed")}
    code = (
        "import warnings; warnings.simplefilter('error')\n"
        "from pagedkv.params.deployment_seed import deployment_seed\n"
        "try:\n    deployment_seed()\nexcept RuntimeWarning as w:\n    print('warned:', w)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True)
    assert "warned: pagedkv: cannot read" in out.stdout and "random hash seed for this process only" in out.stdout
    seeds = {_child_seed(env) for _ in range(2)}
    assert len(seeds) == 2  # each process its own: nothing shared, nothing predictable


def test_a_seed_file_of_the_wrong_size_is_not_used(seed_env: Path) -> None:
    seed_env.parent.mkdir(parents=True)
    seed_env.write_bytes(b"short")
    with pytest.warns(RuntimeWarning, match="holds 5 bytes, not 32"):
        seed = ds._from_file(seed_env)
    assert len(seed) == 32 and seed_env.read_bytes() == b"short"


def test_seeds_give_disjoint_keys() -> None:
    a = hash_tokens(TOKENS, 4, seed=bytes(32))
    b = hash_tokens(TOKENS, 4, seed=b"\x01" * 32)
    assert len(a) == len(b) == 8 and not set(a) & set(b)


def test_weights_version_root_is_the_documented_formula() -> None:
    seed = bytes(range(32))
    base = hashlib.sha256(b"pagedkv-weights\x00" + seed + b"v2").digest()
    salt = hashlib.sha256(b"tenant").digest()
    assert root_digest(seed, None, "v2") == base
    assert root_digest(seed, "tenant", "v2") == bytes(x ^ y for x, y in zip(base, salt, strict=True))
    assert root_digest(seed, "tenant") == bytes(x ^ y for x, y in zip(seed, salt, strict=True))  # MAX's, unchanged
    # salt and version do not commute (XOR-ing both into the seed would make ("a", "b") == ("b", "a"))
    assert root_digest(seed, "a", "b") != root_digest(seed, "b", "a")
    keys = {v: hash_tokens(TOKENS, 4, seed=seed, version=v) for v in (None, "v1", "v2")}
    assert all(not set(keys[a]) & set(keys[b]) for a in keys for b in keys if a != b)
