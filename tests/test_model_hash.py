"""Model hashes ("Model hash" in the image parameters): the SHA-256 of the checkpoint's bytes,
remembered in the user's cache so that a multi-GB file is not hashed on every run, and hashed again
once the file changes."""

from __future__ import annotations

import hashlib
import json
import os

from gencli.pipelines.diffusion.png_parameters import files_hash, hash_cache_path


def test_the_hash_is_the_sha256_of_the_bytes_one_file_after_the_other(tmp_path, monkeypatch):
    monkeypatch.setenv("GENCLI_CACHE_DIR", "")  # no cache
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    a.write_bytes(b"first" * 1000)
    b.write_bytes(b"second")
    assert hash_cache_path() is None
    assert files_hash([a]) == hashlib.sha256(a.read_bytes()).hexdigest()[:10]
    assert files_hash([a, b], length=64) == hashlib.sha256(a.read_bytes() + b.read_bytes()).hexdigest()


def test_a_remembered_hash_is_used_until_the_file_changes(tmp_path, monkeypatch):
    monkeypatch.setenv("GENCLI_CACHE_DIR", str(tmp_path / "cache"))
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"weights")
    real = hashlib.sha256(b"weights").hexdigest()
    assert files_hash([f]) == real[:10]
    cache_file = tmp_path / "cache" / "hashes.json"
    cache = json.loads(cache_file.read_text())
    assert list(cache.values()) == [real]
    # the cache is what answers now: plant a different digest under the same key
    planted = "0" * 64
    cache_file.write_text(json.dumps({k: planted for k in cache}))
    assert files_hash([f]) == planted[:10]
    # a rewrite (new size and modification time) is hashed again and remembered
    f.write_bytes(b"new weights")
    os.utime(f, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns + 10**9))
    assert files_hash([f]) == hashlib.sha256(b"new weights").hexdigest()[:10]
    assert hashlib.sha256(b"new weights").hexdigest() in json.loads(cache_file.read_text()).values()


def test_an_unwritable_or_corrupt_cache_costs_only_the_time(tmp_path, monkeypatch):
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"weights")
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache directory would be")
    monkeypatch.setenv("GENCLI_CACHE_DIR", str(blocker))
    assert files_hash([f]) == hashlib.sha256(b"weights").hexdigest()[:10]
    monkeypatch.setenv("GENCLI_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "hashes.json").write_text("{not json")
    assert files_hash([f]) == hashlib.sha256(b"weights").hexdigest()[:10]
    assert json.loads((tmp_path / "cache" / "hashes.json").read_text())  # rewritten whole
