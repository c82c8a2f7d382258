"""Shared fixtures: tiny random models of every family, the shared stories260K model, Redis."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_MODELS = REPO.parent / "shared" / "models"
STORIES = SHARED_MODELS / "stories260K"


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """family -> directory of a random-weight (std 0.4) tiny model with a byte tokenizer."""
    from engine.demo import FAMILY_CONFIGS, make_random_model

    base = tmp_path_factory.mktemp("tiny")
    return {fam: make_random_model(base / fam, fam, seed=i) for i, fam in enumerate(FAMILY_CONFIGS)}


@pytest.fixture(scope="session")
def stories_dir(tmp_path_factory) -> Path:
    """stories260K converted to a Hugging Face directory by our converter (skips if absent)."""
    if not (STORIES / "stories260K.bin").is_file():
        pytest.skip("shared stories260K model not present")
    from engine.convert.llama2c import convert_llama2c

    out = tmp_path_factory.mktemp("stories260K-hf")
    convert_llama2c(STORIES / "stories260K.bin", STORIES / "tok512.bin", out)
    return out


def redis_available(url: str = "redis://127.0.0.1:6379/0") -> bool:
    try:
        import redis

        return bool(redis.Redis.from_url(url, socket_connect_timeout=0.5).ping())
    except Exception:
        return False


@pytest.fixture(scope="session")
def redis_url() -> str:
    url = os.environ.get("TANDEM_TEST_REDIS", "redis://127.0.0.1:6379/0")
    if not redis_available(url):
        if shutil.which("redis-server") is None:
            pytest.skip("no Redis server available")
        subprocess.run(["redis-server", "--daemonize", "yes", "--port", "6379", "--save", "", "--appendonly", "no"], check=False)
    return url
