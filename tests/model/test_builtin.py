"""The built-in checkpoint: deterministic bytes, atomic creation, a loadable layout."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from ec_frontend.model import builtin
from ec_frontend.model.builtin import (
    BUILTIN_NAME,
    BUILTIN_VERSION,
    SPECIAL_TOKENS,
    default_cache_dir,
    ensure_builtin_checkpoint,
)
from tokenizers import Tokenizer
from transformers import AutoConfig, AutoTokenizer

FILES = [
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "preprocessor_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "video_preprocessor_config.json",
]


def digests(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def test_checkpoint_files_and_name(builtin_model_dir):
    assert builtin_model_dir.name == BUILTIN_NAME
    assert BUILTIN_VERSION in BUILTIN_NAME
    assert sorted(p.name for p in builtin_model_dir.iterdir()) == FILES


def test_creation_is_byte_identical(builtin_model_dir, tmp_path):
    again = ensure_builtin_checkpoint(tmp_path / "a")
    assert again != builtin_model_dir
    assert digests(again) == digests(builtin_model_dir)


@pytest.mark.slow
def test_another_process_writes_identical_bytes(builtin_model_dir, tmp_path):
    code = "import sys; from pathlib import Path; from ec_frontend.model.builtin import " \
        "ensure_builtin_checkpoint as e; print(e(Path(sys.argv[1])))"  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=True
    )
    assert digests(Path(out.stdout.strip())) == digests(builtin_model_dir)


def test_concurrent_creators_share_one_directory(builtin_model_dir, tmp_path):
    results: list[Path] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(4)

    def create() -> None:
        try:
            barrier.wait()
            results.append(ensure_builtin_checkpoint(tmp_path))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=create) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert results == [tmp_path / BUILTIN_NAME] * 4
    assert [p.name for p in tmp_path.iterdir()] == [BUILTIN_NAME]  # no temporary leftovers
    assert digests(tmp_path / BUILTIN_NAME) == digests(builtin_model_dir)


def test_existing_checkpoint_is_reused(tmp_path, monkeypatch):
    first = ensure_builtin_checkpoint(tmp_path)
    stamp = (first / "model.safetensors").stat().st_mtime_ns

    def fail(directory: Path) -> None:
        raise AssertionError("the checkpoint was written again")

    monkeypatch.setattr(builtin, "write_builtin_checkpoint", fail)
    assert ensure_builtin_checkpoint(tmp_path) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp


def test_failed_creation_leaves_nothing(tmp_path, monkeypatch):
    def broken(directory: Path) -> None:
        (directory / "config.json").write_text("{}")
        raise OSError("disk full")

    monkeypatch.setattr(builtin, "write_builtin_checkpoint", broken)
    with pytest.raises(OSError, match="disk full"):
        ensure_builtin_checkpoint(tmp_path)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("env", "expected"),
    [("/srv/cache", Path("/srv/cache")), (None, Path.home() / ".cache" / "ec-frontend")],
)
def test_default_cache_dir(monkeypatch, env, expected):
    if env is None:
        monkeypatch.delenv("EC_FRONTEND_CACHE", raising=False)
    else:
        monkeypatch.setenv("EC_FRONTEND_CACHE", env)
    assert default_cache_dir() == expected


def test_env_cache_dir_is_used(monkeypatch, tmp_path, builtin_model_dir):
    monkeypatch.setenv("EC_FRONTEND_CACHE", os.fspath(tmp_path))
    path = ensure_builtin_checkpoint()
    assert path == tmp_path / BUILTIN_NAME
    assert digests(path) == digests(builtin_model_dir)


def test_tokenizer_loads_in_transformers_like_the_raw_tokenizer(builtin_model_dir):
    hf = AutoTokenizer.from_pretrained(builtin_model_dir)
    raw = Tokenizer.from_file(str(builtin_model_dir / "tokenizer.json"))
    sample = "Hello world! <|im_start|>user\nDescribe 123 cats.<|im_end|> ünïcode ☃"
    ids = hf(sample, add_special_tokens=False)["input_ids"]
    assert ids == raw.encode(sample, add_special_tokens=False).ids
    assert hf.decode(ids) == sample
    specials = [hf.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS]
    assert specials == list(range(len(hf) - len(SPECIAL_TOKENS), len(hf)))
    assert hf.eos_token == "<|im_end|>"


def test_config_matches_the_tokenizer(builtin_model_dir):
    config = AutoConfig.from_pretrained(builtin_model_dir)
    tok = AutoTokenizer.from_pretrained(builtin_model_dir)
    assert config.model_type == "qwen2_vl"
    assert config.image_token_id == tok.convert_tokens_to_ids("<|image_pad|>")
    assert config.vision_start_token_id == tok.convert_tokens_to_ids("<|vision_start|>")
    assert config.text_config.vocab_size >= len(tok)
    assert config.text_config.rope_parameters["mrope_section"] == [2, 3, 3]
    pre = json.loads((builtin_model_dir / "preprocessor_config.json").read_text())
    assert (pre["min_pixels"], pre["max_pixels"]) == (56 * 56, 224 * 224)
